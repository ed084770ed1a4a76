"""The sweep examples run as users run them (a subprocess, on this process's
Keras backend) at a small size; the best model they save loads again and
evaluates the same."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SMALL = ["--trials", "2", "--epochs", "1", "--train-size", "256"]
TIMEOUT = 300  # Seconds; a hung example fails instead of blocking CI.


def example_env(**extra):
    """The environment for an example: this backend, this checkout."""
    path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    return dict(
        os.environ,
        KERAS_BACKEND=keras.backend.backend(),
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        TF_CPP_MIN_LOG_LEVEL="2",
        **extra,
    )


def run_example(script, *args, cwd):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=example_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout


def check_best_model_reloads(out, directory):
    before = re.search(r"^best model: test loss (\S+)$", out, re.M)
    after = re.search(r"^loaded from (.+): test loss (\S+)$", out, re.M)
    assert before and after, out
    assert Path(after.group(1)) == directory / "best.keras"
    assert (directory / "best.keras").is_file()
    assert float(after.group(2)) == pytest.approx(float(before.group(1)))
    assert "loaded model evaluates the same: True" in out


def check_constant_effective_batch(lines):
    pairs = [
        re.search(r"accum_iters=(\d+) batch_size=(\d+)", line).groups()
        for line in lines
    ]
    assert pairs
    assert all(int(k) * int(b) == 64 for k, b in pairs), pairs


def check_sweep(tmp_path, script, trial_line):
    """Runs a sweep example of 2 trials: each trial's line (the lines the
    regular expression `trial_line` finds) keeps the effective batch, and
    the best model reloads."""
    directory = tmp_path / "sweep"
    out = run_example(
        script, *SMALL, "--directory", str(directory), cwd=tmp_path
    )
    trials = [line for line in out.splitlines() if re.search(trial_line, line)]
    assert len(trials) == 2, out
    check_constant_effective_batch(trials)
    check_best_model_reloads(out, directory)


# Each example on one backend here; test_distributed_tuning.py runs the
# KerasTuner one on TensorFlow and the Optuna one on torch.
@pytest.mark.backends("jax")
def test_kerastuner_sweep(tmp_path):
    pytest.importorskip("keras_tuner")
    pytest.importorskip("sklearn")
    check_sweep(tmp_path, "kerastuner_sweep.py", "val_loss=")


@pytest.mark.backends("jax")
def test_optuna_sweep(tmp_path):
    pytest.importorskip("optuna")
    pytest.importorskip("sklearn")
    check_sweep(tmp_path, "optuna_sweep.py", "^trial ")


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The callback talks to Optuna only; one backend runs it.
@pytest.mark.backends("torch")
def test_optuna_pruning_callback_stops_a_trial_after_the_reported_epoch():
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("sklearn")
    example = _load_example("optuna_sweep")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Prunes any trial whose reported value is above 0: every loss.
    study = optuna.create_study(
        pruner=optuna.pruners.ThresholdPruner(upper=0.0)
    )
    x = np.random.default_rng(0).normal(size=(32, 64)).astype("float32")
    y = np.arange(32) % 10
    data = ((x, y), (x, y))
    params = {"accum_iters": 2, "learning_rate": 1e-2}

    def objective(trial):
        callback = example.OptunaPruning(trial)
        _, history = example.train(params, data, 3, [callback])
        return history.history["val_loss"][-1]

    study.optimize(objective, n_trials=1)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert list(trial.intermediate_values) == [0]  # Stopped after epoch 1.


# Backend-independent: the weighted windows' backend code is covered in
# test_weighted_windows.py on every backend.
@pytest.mark.backends("torch")
def test_uneven_batches_example_weighs_its_way_to_the_big_batch(tmp_path):
    # 300 samples: a short micro-batch of 12 and a partial window.
    out = run_example(
        "uneven_batches.py", "--samples", "300", "--epochs", "1", cwd=tmp_path
    )
    differences = {}
    section = None
    for line in out.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            section = line
        match = re.match(r"^\s+(.+?)\s+max \|dw\| = (\S+)$", line)
        if match:
            differences[section, match[1]] = float(match[2])
    assert len(differences) == 6, out
    for (section, run), difference in differences.items():
        if run.startswith("weigh_micro_batches"):
            assert difference < 1e-5, (section, run, difference)
        else:
            assert difference > 1e-4, (section, run, difference)
