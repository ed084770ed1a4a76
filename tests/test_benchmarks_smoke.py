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
# The memory runs (a fresh worker process per configuration, which reads
# its own peak RSS) are the timing worker's training in another process:
# one backend's smoke run measures them, the others pass `--no-memory`.
MEMORY = keras.backend.backend() == "jax"


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
            *([] if MEMORY else ["--no-memory"]),
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
    if MEMORY:
        assert results["memory"][0]["peak_rss_bytes"] > 0
    else:
        assert results["memory"] == []
    table = (tmp_path / "results.md").read_text()
    for column in ("ours4/parent", "ours4/keras", "ours4/ideal", "state"):
        assert column in table
    # A report on the product, not on an acceptance gate.
    assert "**NO**" not in table and "bar" not in table
    assert (tmp_path / "results.png").stat().st_size > 1000


PROFILES = [
    pytest.param(
        ["--windows", "2", "--optimizers", "adam"], id="window_steps-adam"
    ),
    pytest.param(
        ["--windows", "2", "--optimizers", "adam", "--xla"],
        marks=pytest.mark.backends("tensorflow"),
        id="window_steps-adam-xla",
    ),
    pytest.param(
        [
            "--windows",
            "2",
            "--optimizers",
            "adam",
            "--skip-nonfinite",
            "--micro-batch",
            "5",
        ],
        id="window_steps-adam-skip",
    ),
    pytest.param(
        ["--windows", "2", "--optimizers", "adam", "--noise-scale"],
        id="window_steps-adam-noise",
    ),
]


@pytest.mark.parametrize("arguments", PROFILES)
def test_window_profiler_runs_and_prints_its_table(arguments, capsys):
    # In this process: `python -m benchmarks.window_steps` calls `main`
    # alone, and a second process would only import the backend again.
    from benchmarks import window_steps

    window_steps.main(arguments)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:2] == "| "]
    # The header and a row per configuration.
    assert len(rows) >= 4
    if "--skip-nonfinite" in arguments:
        assert "| ours_k4_skip |" in out
    if "--noise-scale" in arguments:
        assert "| ours_k4_noise |" in out
        assert "ours_k4_skip" not in out
    if "--micro-batch" in arguments:
        assert "micro-batch 5," in out
    # Keras' built-in made to wait for the backward pass: in a TensorFlow
    # graph, beside the other three.
    graph = keras.backend.backend() == "tensorflow" and "--xla" not in arguments
    toggled = {"--skip-nonfinite", "--noise-scale"} & set(arguments)
    waiting = "| keras_builtin_k4_after_backward |" in out
    assert waiting == (graph and not toggled)


@pytest.mark.backends("tensorflow")
def test_compiled_close_profile_prints_a_row_per_size(capsys):
    from benchmarks import window_steps

    window_steps.main(["--compiled-close", "--sizes", "300", "--windows", "1"])
    rows = capsys.readouterr().out.splitlines()[-2:]
    assert rows[0] == "|---|---|---|---|"
    parameters, compiled, plain, ratio = rows[1].strip("| ").split(" | ")
    assert 250 <= int(parameters) <= 350
    assert float(compiled) > 0 and float(plain) > 0 and float(ratio) > 0


@pytest.mark.backends("tensorflow")
def test_keras_builtin_after_backward_trains_as_keras_builtin():
    # The configuration only orders Keras' built-in's writes after the
    # backward pass: its weights are the built-in's, to the bit.
    import numpy as np
    from helpers import regression_data
    from helpers import small_model

    from benchmarks.after_backward import after_backward

    x, y = regression_data(0, 32)
    weights = []
    for cls in (keras.optimizers.Adam, after_backward(keras.optimizers.Adam)):
        model = small_model(0)
        model.compile(cls(gradient_accumulation_steps=2), "mse")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for ours, theirs in zip(*weights):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.backends("jax")
def test_optax_skip_benchmark_times_both_skips_on_one_model(capsys):
    pytest.importorskip("optax")
    from benchmarks import optax_skip

    optax_skip.main(["--windows", "2", "--micro-batch", "4"])
    out = capsys.readouterr().out
    for config in ("ours_k4", "ours_k4_skip", "optax_k4", "optax_k4_skip"):
        assert f"| {config} |" in out
    assert "optax_k4_skip / ours_k4_skip:" in out


@pytest.mark.backends("jax")
def test_memory_benchmark_measures_peaks_and_reports_extra_over_sums(capsys):
    # The JAX worker in this process (`python -m benchmarks.memory` runs it
    # in a process per backend), on the smoke workload; no ratio is judged.
    from benchmarks import memory

    memory.main(["--worker", "jax", "--smoke", "--workloads", "mlp"])
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["config"] for r in records] == memory.CONFIGS
    for record in records:
        assert record["peak_bytes"] > record["sums_bytes"] > 0
    ours = next(r for r in records if r["config"] == "ours_k4")
    parent = next(r for r in records if r["config"] == "parent")
    # The optimizer's state grows by the sums and three scalar counters
    # (and a flag per variable).
    extra_state = ours["state_bytes"] - parent["state_bytes"]
    assert 0 <= extra_state - ours["sums_bytes"] <= 64
    table = memory.table(records)
    assert "| jax | mlp | peak |" in table


@pytest.mark.backends("torch")
def test_torch_ddp_benchmark_counts_one_exchange_per_window():
    # 2 gloo ranks; only the counts are judged, never the rates.
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.torch_ddp", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[3:5]
        for line in result.stdout.splitlines()
        if line.startswith(("| every_step", "| per_window", "| overlap"))
    }
    assert [c.strip() for c in rows["every_step"]] == ["4", "4"]
    assert [c.strip() for c in rows["per_window"]] == ["1", "0"]
    # One bucket behind the last backward, and the two scalars at the close.
    assert [c.strip() for c in rows["overlap"]] == ["2", "0"]


def test_ddp_model_is_its_formulas():
    # A ring all-reduce of S bytes over p ranks: 2 (p - 1) / p * S each
    # way. 8 MB over 4 ranks at 1 Gbit/s: 1.5 * 8e6 / 1.25e8 = 96 ms.
    from benchmarks import ddp_model

    exchange = ddp_model.all_reduce_s(8e6, 4, 1.0)
    assert exchange == pytest.approx(0.096)
    # 100 ms of compute, half of it behind which 96 ms can hide: 46 ms
    # stay exposed, 4 times for DDP, once with the overlap.
    ways = ddp_model.window_s(0.1, exchange, 4, 0.5)
    assert ways["ddp_every_step"] == pytest.approx(4 * (0.1 + 0.046))
    assert ways["sync_at_close"] == pytest.approx(0.4 + 0.096)
    assert ways["sync_overlap"] == pytest.approx(0.4 + 0.046)
    table = ddp_model.table(ddp_model.parse(["--compute-ms", "100"]))
    assert len(table.splitlines()) == 2 + 3 * 6  # 3 bandwidths, 6 rank counts


def test_gpu_check_smoke_reports_every_step_of_this_backend(tmp_path):
    # On a CPU: a few steps of small models; what needs a GPU is a
    # 'skipped: no GPU' cell, never a figure. Only the exactness figure
    # is judged: ours at b against Adam at 4b.
    backend = keras.backend.backend()
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--smoke"]
    result = subprocess.run(
        command + ["--backends", backend, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = record["results"][backend]
    assert steps["device"]["status"] == "ok"
    assert steps["speed"]["status"] == "ok"
    assert steps["speed"]["ours_over_parent"] > 0
    assert steps["speed"]["ours_over_keras"] > 0
    assert steps["memory"]["status"] == "ok"
    assert steps["memory"]["sums_bytes"] > 0
    gpu = steps["device"]["gpu"]
    expected = "skipped: --smoke" if gpu else "skipped: no GPU"
    assert steps["fit_to_memory"]["status"] == expected
    # Default Adam moves a weight by about 1e-3 per update: a wrong update
    # is far above this; float32 round-off over 2 updates far below.
    assert steps["device"]["max_abs_difference"] < 1e-4
    table = (tmp_path / "gpu_check.md").read_text()
    assert f"| {backend} |" in table and expected in table
    assert "smoke" in table


def test_gpu_check_fails_a_backend_without_gpu_unless_smoke():
    from benchmarks import gpu_check

    cpu_only = {"jax": {"device": {"status": "ok", "gpu": False}}}
    for smoke, runs in ((False, False), (True, True)):
        args = gpu_check.parse(["--backends", "jax"] + ["--smoke"] * smoke)
        reason = gpu_check.skipped_because("speed", "jax", cpu_only, args)
        assert (reason is None) == runs
        results = {"jax": {"device": {"status": "ok"}, "speed": {}}}
        results["jax"]["speed"]["status"] = reason or "ok"
        assert gpu_check.succeeded(results, args) == smoke
    failed = {"jax": {"device": {"status": "failed"}}}
    assert not gpu_check.succeeded(failed, args)


@pytest.mark.backends("jax")
def test_time_to_accuracy_smoke_prints_a_row_per_configuration():
    # Two epochs of a subset of both tasks, one seed; no accuracy is judged.
    pytest.importorskip("mnist1d")
    from benchmarks import time_to_accuracy

    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.time_to_accuracy", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for task in ("digits", "mnist1d"):
        for config in time_to_accuracy.CONFIGS:
            assert f"| {task} | {config} | " in result.stdout, (task, config)


def test_worker_builds_its_configurations_in_the_order_rotated(monkeypatch):
    from benchmarks import worker

    built = []

    def building(workload, config, *args):
        built.append(config)
        return None, 1

    def failing(*args):
        raise RuntimeError("not timed")

    monkeypatch.setattr(worker, "compiled_model", building)
    monkeypatch.setattr(worker, "train_seconds", failing)
    only = ["parent", "ours_k4", "ours_k1"]
    records = list(
        worker.time_group("mlp", "adam", MODE, False, 1, True, only, 4)
    )
    assert built == ["ours_k4", "ours_k1", "parent"]
    # Records keep the configurations' own order, whatever the builds'.
    assert [r["config"] for r in records] == only


@pytest.mark.backends("tensorflow")
def test_compile_cost_prints_each_fit_and_what_auto_chose(capsys):
    pytest.importorskip("keras_hub")
    from benchmarks import compile_cost

    compile_cost.main(["--smoke"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:2] == "| "]
    assert len(rows) == 5  # the header and four configurations
    # A one-layer model of 17 K parameters: "auto" leaves it uncompiled.
    assert '| jit_compile="auto" (= False) |' in out
    assert all(float(row.split(" | ")[1]) > 0 for row in rows[1:])
    assert "the closing call, median of 1 windows: " in out
