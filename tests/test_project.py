"""Project promises: README's commands, CI, the demo."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("pip ")]


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = _readme_commands()
    assert "accum_optimizers.demo" in demo
    assert "scripts/run_tests.py" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    _, tests = _readme_commands()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_demo_trains_both_runs_to_the_same_weights(capsys):
    pytest.importorskip("sklearn")
    from accum_optimizers import demo

    difference = demo.main(["--epochs", "1", "--accum-iters", "3"])
    out = capsys.readouterr().out
    assert "AdamAccumulate(accum_iters=3), batch 16" in out
    assert difference < 1e-5


def test_test_runner_reports_a_missing_backend_as_skipped_and_fails(
    monkeypatch, capsys
):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "run_tests", ROOT / "scripts" / "run_tests.py"
    )
    run_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_tests)
    monkeypatch.setattr(
        run_tests.importlib.util, "find_spec", lambda name: None
    )
    assert run_tests.main(["--backends", "torch"]) == 1
    out = capsys.readouterr().out
    assert "torch       SKIPPED: backend not installed" in out
    assert "MISSING BACKENDS: torch" in out
    assert "tests: 0 passed, 0 failed, 0 skipped" in out
    assert run_tests.main(["--backends", "torch", "--allow-missing"]) == 0
