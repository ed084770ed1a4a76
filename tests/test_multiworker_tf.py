"""`MultiWorkerMirroredStrategy`: 2 worker processes over 127.0.0.1.

The test starts both tasks of `multiworker_worker.py` with their
`TF_CONFIG`, waits with a timeout, and stops them on any failure. The
oracle is the parent Keras optimizer in this process, without a strategy,
on the global batch `accum_iters * per-worker batch * workers`.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.backends("tensorflow")

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 300


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_workers(out):
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    processes = []
    try:
        for index in range(len(workers)):
            tf_config = {
                "cluster": {"worker": workers},
                "task": {"type": "worker", "index": index},
            }
            env = dict(
                os.environ,
                KERAS_BACKEND="tensorflow",
                TF_CPP_MIN_LOG_LEVEL="3",
                TF_CONFIG=json.dumps(tf_config),
            )
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "multiworker_worker.py"), out],
                    cwd=HERE,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, log in zip(processes, logs):
        assert process.returncode == 0, log[-3000:]


@pytest.fixture(scope="module")
def worker_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiworker")
    run_workers(str(out))
    return dict(np.load(out / "weights.npz"))


def parent_weights():
    import keras
    from helpers import PARENTS
    from helpers import regression_data
    from helpers import small_model
    from multiworker_worker import GLOBAL_MICRO
    from multiworker_worker import K
    from multiworker_worker import N

    from accum_optimizers import AdamAccumulate

    x, y = regression_data(5, N)
    model = small_model(0)
    model.compile(
        optimizer=PARENTS[AdamAccumulate](
            0.01, global_clipnorm=0.5, amsgrad=True
        ),
        loss="mse",
    )
    model.fit(x, y, batch_size=K * GLOBAL_MICRO, shuffle=False, verbose=0)
    keras.backend.clear_session()
    return model.get_weights()


def test_two_workers_equal_one_process_global_batch(worker_weights):
    expected = parent_weights()
    for i, weight in enumerate(expected):
        np.testing.assert_allclose(
            worker_weights[f"fit_{i}"], weight, rtol=1e-5, atol=1e-6
        )
    assert worker_weights["iterations"] == 2


def test_checkpoint_mid_window_resumes_under_the_strategy(worker_weights):
    assert worker_weights["pending"] == 2
    for i, weight in enumerate(parent_weights()):
        np.testing.assert_allclose(
            worker_weights[f"resumed_{i}"], weight, rtol=1e-5, atol=1e-6
        )
