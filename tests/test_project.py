"""Project promises: README's commands, CI, the demo.

Runs in the torch process only: the files and the test runner do not depend
on the backend, and the demo's training is the optimizers' own, which every
backend's other tests check against the big batch.
"""

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import largest_difference

pytestmark = pytest.mark.backends("torch")

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("pip ")]


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = _readme_commands()
    assert "accum_optimizers.demo" in demo
    assert "scripts/run_tests.py" in tests


def test_readme_says_how_to_install_before_its_usage():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("\n## Install\n") < readme.index("\n## Usage\n")


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _readme_commands()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One short demo run with `--plot`: its runs, stdout and PNG path."""
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from accum_optimizers import demo

    png = tmp_path_factory.mktemp("demo") / "demo.png"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runs = demo.main(
            ["--epochs", "1", "--accum-iters", "3", "--train-images", "480"]
            + ["--plot", str(png)]
        )
    return runs, out.getvalue(), png


def test_demo_matches_the_big_batch_where_the_contrast_runs_do_not(
    demo_run,
):
    runs, out, _ = demo_run
    for label in (
        "Adam, batch 48",
        "AdamAccumulate(accum_iters=3), batch 16",
        "Adam, batch 16",
        "Adam(gradient_accumulation_steps=3), batch 16",
    ):
        assert label in out
    # The oracle is Keras' own Adam on the big batch (the first run).
    big, ours, small, builtin = runs
    reference = big.model.get_weights()

    def distance(run):
        return largest_difference(run.model.get_weights(), reference)

    assert distance(ours) < 1e-5
    assert distance(small) > 1e-2
    # Its schedule sees micro-steps: same gradients, other learning rates.
    assert distance(builtin) > 1e-3
    assert int(ours.model.optimizer.iterations) == int(
        big.model.optimizer.iterations
    )
    assert "calls the schedule with micro-steps" in out
    assert "Timings" in out


def test_demo_plot_writes_a_png(demo_run):
    _, out, png = demo_run
    assert f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_demo_help_describes_every_flag(capsys):
    from accum_optimizers import demo

    with pytest.raises(SystemExit):
        demo.main(["--help"])
    out = capsys.readouterr().out
    flags = ("--accum-iters", "--micro-batch", "--epochs", "--train-images")
    flags += ("--seed", "--plot")
    for flag in flags:
        line = next(x for x in out.splitlines() if x.strip().startswith(flag))
        assert len(line.split(maxsplit=2)) == 3, line  # flag, value, help


def _test_runner():
    spec = importlib.util.spec_from_file_location(
        "run_tests", ROOT / "scripts" / "run_tests.py"
    )
    run_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_tests)
    return run_tests


def test_test_runner_reports_a_missing_backend_as_skipped_and_fails(
    monkeypatch, capsys
):
    run_tests = _test_runner()
    monkeypatch.setattr(
        run_tests.importlib.util, "find_spec", lambda name: None
    )
    assert run_tests.main(["--backends", "torch"]) == 1
    out = capsys.readouterr().out
    assert "torch       SKIPPED: backend not installed" in out
    assert "MISSING BACKENDS: torch" in out
    assert "tests: 0 passed, 0 failed, 0 skipped" in out
    assert run_tests.main(["--backends", "torch", "--allow-missing"]) == 0


def test_test_runner_runs_backends_side_by_side_and_reports_each(
    monkeypatch, capsys
):
    run_tests = _test_runner()
    monkeypatch.setattr(run_tests.importlib.util, "find_spec", lambda n: 1)
    calls = []

    def run_backend(backend, pytest_args, streamed=True):
        calls.append((backend, streamed))
        failed = int(backend == "jax")
        return {"passed": 2, "failed": failed, "skipped": 1}, 1.0

    monkeypatch.setattr(run_tests, "run_backend", run_backend)
    assert run_tests.main(["--jobs", "2"]) == 1  # jax's failure
    assert sorted(calls) == [
        ("jax", False),
        ("tensorflow", False),
        ("torch", False),
    ]
    lines = capsys.readouterr().out.splitlines()
    summary = lines[lines.index("=== summary per backend") + 1 :]
    assert [line.split()[0] for line in summary[:3]] == list(run_tests.BACKENDS)
    assert summary[3] == "tests: 6 passed, 1 failed, 3 skipped"
    calls.clear()
    assert run_tests.main(["--jobs", "1", "--backends", "torch"]) == 0
    assert calls == [("torch", True)]  # one at a time: streamed
    for jobs, named in (("0", "0"), ("two", "'two'")):
        with pytest.raises(SystemExit):
            run_tests.main(["--jobs", jobs])
        error = capsys.readouterr().err
        assert f"--jobs must be an integer >= 1, got {named}" in error


def _clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")
    }
    return dict(env, **extra)


def test_demo_help_answers_without_importing_keras(tmp_path):
    # A `keras` that cannot be imported: `--help` must not need it.
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text(
        "raise ImportError('--help imported Keras')\n"
    )
    pythonpath = os.pathsep.join([str(tmp_path), str(ROOT)])
    result = subprocess.run(
        [sys.executable, "-m", "accum_optimizers.demo", "--help"],
        cwd=tmp_path,
        env=_clean_env(PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--accum-iters" in result.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="TensorFlow not installed",
)
def test_demo_hides_tensorflow_start_up_lines():
    code = (
        "from accum_optimizers import _demo_cli\n"
        "_demo_cli.quiet_tensorflow()\n"
        "import tensorflow as tf\n"
        "tf.constant(1.0) + 1\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "oneDNN" not in result.stderr
    assert "InitializeLog" not in result.stderr
