"""Distributed tuning on one machine, as docs/sweeps.md runs it on several:
KerasTuner's chief and two workers (gRPC on 127.0.0.1), and two Optuna
workers sharing a SQLite study. The processes run the examples; every wait
is bounded and every process is killed at the end.

Each on one backend only (KerasTuner on TensorFlow, Optuna on torch): the
processes are slow to start, and the examples' own tests cover every
backend."""

import socket
import subprocess
import sys
import time

import pytest
from test_examples import EXAMPLES
from test_examples import SMALL
from test_examples import check_best_model_reloads
from test_examples import example_env

TIMEOUT = 300  # Seconds for all the processes of one test together.


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_all(commands, cwd):
    """Runs `{name: (args, env)}` concurrently; returns `{name: output}`.

    Fails if any process exits non-zero or the processes together take
    longer than `TIMEOUT`; kills whatever is still running before returning.
    """
    processes, logs = {}, {}
    deadline = time.monotonic() + TIMEOUT
    try:
        for name, (args, env) in commands.items():
            logs[name] = cwd / f"{name}.log"
            with open(logs[name], "w") as log:
                processes[name] = subprocess.Popen(
                    [sys.executable, *args],
                    cwd=cwd,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        for name, process in processes.items():
            remaining = max(deadline - time.monotonic(), 1)
            try:
                process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running after {TIMEOUT} s")
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    outputs = {name: log.read_text() for name, log in logs.items()}
    for name, process in processes.items():
        assert process.returncode == 0, f"{name}:\n{outputs[name][-4000:]}"
    return outputs


@pytest.mark.backends("tensorflow")
def test_kerastuner_chief_and_two_workers(tmp_path):
    pytest.importorskip("keras_tuner")
    pytest.importorskip("sklearn")
    directory = tmp_path / "sweep"
    args = [
        str(EXAMPLES / "kerastuner_sweep.py"),
        *SMALL,
        "--directory",
        str(directory),
    ]
    port = str(free_port())

    def env(tuner_id):
        return example_env(
            KERASTUNER_TUNER_ID=tuner_id,
            KERASTUNER_ORACLE_IP="127.0.0.1",
            KERASTUNER_ORACLE_PORT=port,
            # gRPC would send even 127.0.0.1 through a configured proxy.
            no_grpc_proxy="127.0.0.1",
        )

    outputs = run_all(
        {name: (args, env(name)) for name in ("chief", "tuner0", "tuner1")},
        tmp_path,
    )
    # The chief runs no trial itself: the two it reports ran on workers.
    trials = [
        line for line in outputs["chief"].splitlines() if "val_loss=" in line
    ]
    assert len(trials) == 2, outputs["chief"]
    check_best_model_reloads(outputs["chief"], directory)
    for worker in ("tuner0", "tuner1"):
        assert "best model" not in outputs[worker]


@pytest.mark.backends("torch")
def test_optuna_two_workers_share_a_sqlite_study(tmp_path):
    optuna = pytest.importorskip("optuna")
    pytest.importorskip("sklearn")
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    # Created here, once: two processes creating it at once would race.
    optuna.create_study(
        study_name="accum_iters", storage=storage, direction="minimize"
    )
    args = [
        str(EXAMPLES / "optuna_sweep.py"),
        *SMALL,
        "--trials",
        "1",
        "--storage",
        storage,
        "--search-only",
    ]
    run_all(
        {name: (args, example_env()) for name in ("worker0", "worker1")},
        tmp_path,
    )
    study = optuna.load_study(study_name="accum_iters", storage=storage)
    states = [trial.state for trial in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 2
    for trial in study.trials:
        assert trial.params["accum_iters"] in (1, 2, 4, 8)
