"""The 2 gloo ranks of `test_distribution_torch.py`: their launcher, and
the oracle, the parent Keras optimizer in this process on the global batch
`accum_iters * per-rank batch * ranks`."""

import os
import subprocess
import time

from helpers import TESTS
from helpers import start_logged

TIMEOUT_S = 240


def run_ranks(out, world_size):
    """Runs every rank to completion, or kills them all; judges exit codes.

    Each rank's output goes to `out/rank{r}.log` (a file, not a pipe: no
    rank can block on a full pipe while the test waits on another).
    """
    # A file rendezvous: a port picked beforehand can be taken by another
    # process before rank 0 binds it.
    store = out / "rendezvous"
    processes = []
    timed_out = False
    try:
        for rank in range(world_size):
            env = dict(
                os.environ,
                KERAS_BACKEND="torch",
                ACCUM_INIT_METHOD=f"file://{store}",
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                OMP_NUM_THREADS="1",  # 2 processes on 2 cores
                # This checkout's package, not an installed one.
                PYTHONPATH=os.pathsep.join(
                    [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
                ),
                TF_CPP_MIN_LOG_LEVEL="3",
            )
            worker = [TESTS / "distribution_torch_worker.py", out]
            processes.append(start_logged(worker, env, out / f"rank{rank}.log"))
        deadline = time.monotonic() + TIMEOUT_S
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    failures = [f"timed out after {TIMEOUT_S} s"] if timed_out else []
    for rank, process in enumerate(processes):
        if process.returncode != 0:
            tail = (out / f"rank{rank}.log").read_text()[-3000:]
            failures.append(
                f"rank {rank} exited with {process.returncode}:\n{tail}"
            )
    assert not failures, "\n\n".join(failures)


def parent_weights(case):
    from distribution_torch_worker import CASES as WORKER_CASES
    from distribution_torch_worker import DATA_SEED
    from distribution_torch_worker import GLOBAL_MICRO
    from distribution_torch_worker import K
    from distribution_torch_worker import N
    from helpers import PARENTS
    from helpers import regression_data
    from helpers import small_model

    optimizer_class, kwargs = WORKER_CASES[case]
    x, y = regression_data(DATA_SEED, N)
    model = small_model(0)
    model.compile(optimizer=PARENTS[optimizer_class](**kwargs), loss="mse")
    model.fit(x, y, batch_size=K * GLOBAL_MICRO, shuffle=False, verbose=0)
    return model.get_weights()
