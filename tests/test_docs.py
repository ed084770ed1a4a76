"""The documentation site: the API page, the nav, a guide's example, and
the README's usage snippet.

The page checks read files only; the examples run on every backend.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

import accum_optimizers

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _nav_pages():
    text = (ROOT / "mkdocs.yml").read_text()
    return set(
        re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", text, re.M)
    )


@pytest.mark.backends("jax")
def test_every_public_name_has_a_block_on_the_api_page():
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: accum_optimizers\.(\w+)$", api, re.M))
    assert set(accum_optimizers.__all__) <= documented
    # And no block for a name that is not public (a typo fails the build).
    assert documented <= set(accum_optimizers.__all__)


@pytest.mark.backends("jax")
def test_every_page_is_in_the_nav_and_every_nav_page_exists():
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    nav = _nav_pages()
    # The changelog is generated from CHANGELOG.md at build time.
    assert pages == nav - {"changelog.md"}


def _code_block(text, title):
    pattern = r'```python title="' + re.escape(title) + r'"\n(.*?)```'
    return re.search(pattern, text, re.S).group(1)


def test_tf1_guide_example_prints_what_the_guide_shows():
    page = (DOCS / "migrate" / "tf1-accumulate-ops.md").read_text()
    code = _code_block(page, "Keras 3 with SGDAccumulate")
    shown = re.search(
        r"on every backend:\n\n```text\n(.*?)```", page, re.S
    ).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "tf1-accumulate-ops.md", "exec"), {})
    assert out.getvalue() == shown
    # The oracle, by hand: one SGD step on the mean gradient of the rows,
    # d mean(x @ W) / dW[i, j] = mean(x[:, i]) / 3 = [14, 15, 16][i] / 3.
    assert "[[0.53333 1.53333 2.53333]" in shown  # 1 - 0.1 * 14 / 3
    assert "[6.46667 7.46667 8.46667]]" in shown  # 7 - 0.1 * 16 / 3


def _readme_usage():
    readme = (ROOT / "README.md").read_text()
    usage = readme[readme.index("\n## Usage\n") :]
    return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def test_readme_usage_runs_as_written(capsys):
    # The snippet as a user copies it: it defines its own model and data,
    # trains, and asks `check_exactness` whether the run is the big batch,
    # which compares it with Keras' own Adam at batch 50.
    namespace = {}
    exec(compile(_readme_usage(), "README.md", "exec"), namespace)
    assert namespace["report"].exact
    assert "FlushAccumulation" in namespace  # the snippet ran to its end


@pytest.mark.backends("jax")
def test_the_performance_page_stays_short():
    # What it costs, the tables, what to pick, how to rerun: how a figure
    # was found goes in the commit that records it.
    page = (DOCS / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 250
