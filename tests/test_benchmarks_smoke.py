"""The benchmark command, in smoke mode, and the window profiler, on the
current backend.

Only checks that they run and write their JSON, markdown table and chart
(the profiler: prints its table); timing ratios are never asserted in
tests.
"""

import json
import subprocess
import sys
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODE = {"tensorflow": "tensorflow-xla"}.get(
    keras.backend.backend(), keras.backend.backend()
)


def test_benchmark_smoke_run_writes_json_table_and_chart(tmp_path):
    pytest.importorskip("matplotlib")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--modes",
            MODE,
            "--workloads",
            "mlp",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    configs = {(r["workload"], r["config"]) for r in results["timings"]}
    assert len(configs) == 6  # every configuration of the chosen workload
    assert all(r["samples_per_s"] > 0 for r in results["timings"])
    assert results["memory"] and results["memory"][0]["peak_rss_bytes"] > 0
    table = (tmp_path / "results.md").read_text()
    for column in ("ours4/parent", "ours4/keras", "ours4/ideal", "state"):
        assert column in table
    # A report on the product, not on an acceptance gate.
    assert "**NO**" not in table and "bar" not in table
    assert (tmp_path / "results.png").stat().st_size > 1000


PROFILES = [
    pytest.param(
        ["benchmarks.window_steps", "--windows", "2", "--optimizers", "adam"],
        id="window_steps-adam",
    ),
    pytest.param(
        ["benchmarks.window_steps", "--windows", "2", "--optimizers", "adam"]
        + ["--xla"],
        marks=pytest.mark.backends("tensorflow"),
        id="window_steps-adam-xla",
    ),
]


@pytest.mark.parametrize("command", PROFILES)
def test_window_profiler_runs_and_prints_its_table(command):
    result = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line[:2] == "| "]
    # The header and a row per configuration.
    assert len(rows) >= 4
