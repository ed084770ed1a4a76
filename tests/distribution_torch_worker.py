"""Worker for test_distribution_torch.py: one rank of torch DDP over gloo.

    ACCUM_INIT_METHOD=file:///tmp/store RANK=r WORLD_SIZE=2 \
        KERAS_BACKEND=torch python distribution_torch_worker.py OUT

(`ACCUM_INIT_METHOD` defaults to `env://`: MASTER_ADDR and MASTER_PORT.)

The setup of Keras' guide "Multi-GPU distributed training with PyTorch", on
CPU processes: each rank builds the same small Keras model (a
`torch.nn.Module` under the torch backend), wraps it in
`torch.nn.parallel.DistributedDataParallel` and trains it in a custom torch
loop. For every case in `CASES`, on every micro-step, each rank

1. feeds its own `B` samples of a global micro-batch of `B * WORLD_SIZE`
   through the DDP-wrapped model and takes the MSE;
2. calls `loss.backward()`, during which DDP averages the gradients over the
   ranks (through an all-reduce comm hook that counts its calls);
3. hands the averaged `.grad` of every Keras variable's torch `Parameter`
   to our optimizer's `apply` (with `accum_iters=K`), under
   `torch.no_grad()` as Keras' own torch trainer does, then zeroes them.

Each case is also run once per window: the forward and backward passes of
every micro-step under `ddp.no_sync()` (no gradient crosses ranks) and the
optimizer under `torch_distributed.sync_windows`, which all-reduces the
window's sums when it closes; `torch.distributed.all_reduce` is wrapped to
count its calls.

Every rank writes its final weights, its optimizer's counters and the
number of gradient all-reduces to `OUT/rank{RANK}.npz`; the test compares
them with the parent Keras optimizer on one process with the global batch
`K * B * WORLD_SIZE`.
"""

import contextlib
import datetime
import os
import sys
from pathlib import Path

import keras
import numpy as np
import torch
import torch.distributed as dist
from helpers import regression_data
from helpers import small_model
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers.torch_distributed import sync_windows

K, B, WORLD_SIZE, WINDOWS = 3, 4, 2, 2
GLOBAL_MICRO = B * WORLD_SIZE
N = WINDOWS * K * GLOBAL_MICRO
DATA_SEED = 5
CASES = {
    "adam": (AdamAccumulate, {"learning_rate": 0.01}),
    "sgd_nesterov_momentum": (
        SGDAccumulate,
        {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
    ),
}


def counting_allreduce(state, bucket):
    """DDP's default gradient all-reduce (sum / world size), counted."""
    state["reductions"] += 1
    return default_hooks.allreduce_hook(None, bucket)


@contextlib.contextmanager
def counting_all_reduces(state):
    """Counts the calls of `torch.distributed.all_reduce` in the block."""
    original = dist.all_reduce

    def counted(*args, **kwargs):
        state["all_reduces"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def train(case, rank, x, y, windows=False):
    """Trains one case; `windows`: micro-steps under `no_sync()` and the
    optimizer under `sync_windows` (keys suffixed `_windows`)."""
    optimizer_class, kwargs = CASES[case]
    model = small_model(0)
    ddp = DistributedDataParallel(model)
    state = {"reductions": 0, "all_reduces": 0}
    ddp.register_comm_hook(state, counting_allreduce)
    optimizer = optimizer_class(accum_iters=K, **kwargs)
    if windows:
        sync_windows(optimizer)
    variables = model.trainable_variables
    for start in range(0, N, GLOBAL_MICRO):
        lo = start + rank * B
        xb = torch.from_numpy(x[lo : lo + B])
        yb = torch.from_numpy(y[lo : lo + B])
        with ddp.no_sync() if windows else contextlib.nullcontext():
            loss = torch.mean(torch.square(ddp(xb) - yb))
            loss.backward()  # without no_sync, DDP averages the gradients
        # A Keras torch variable's `.value` is its `torch.nn.Parameter`.
        grads = [v.value.grad for v in variables]
        with torch.no_grad(), counting_all_reduces(state):
            optimizer.apply(grads, variables)
        ddp.zero_grad()
    case = f"{case}_windows" if windows else case
    results = {f"{case}_w{i}": w for i, w in enumerate(model.get_weights())}
    results[f"{case}_iterations"] = int(
        keras.ops.convert_to_numpy(optimizer.iterations)
    )
    results[f"{case}_micro_batches_seen"] = int(
        keras.ops.convert_to_numpy(optimizer.micro_batches_seen)
    )
    results[f"{case}_micro_steps"] = int(
        keras.ops.convert_to_numpy(optimizer.micro_steps)
    )
    results[f"{case}_reductions"] = state["reductions"]
    results[f"{case}_all_reduces"] = state["all_reduces"]
    return results


def flush_partial_windows(rank, x, y):
    """`flush` under `sync_windows`: a partial window of 2 micro-steps
    (keys `flush_*`), then one whose micro-batch on rank 1 is NaN (keys
    `flush_nan_*`: every rank must discard it, none left waiting)."""
    model = small_model(0)
    optimizer = sync_windows(SGDAccumulate(learning_rate=0.1, accum_iters=K))
    variables = model.trainable_variables
    results = {}
    for name, steps, poisoned in (("flush", 2, False), ("flush_nan", 1, True)):
        for step in range(steps):
            lo = step * GLOBAL_MICRO + rank * B
            xb = torch.from_numpy(x[lo : lo + B])
            yb = torch.from_numpy(y[lo : lo + B])
            loss = torch.mean(torch.square(model(xb) - yb))
            if poisoned and rank == 1:
                loss = loss * float("nan")
            loss.backward()
            grads = [v.value.grad for v in variables]
            with torch.no_grad():
                optimizer.apply(grads, variables)
            model.zero_grad()
        optimizer.flush()
        for i, w in enumerate(model.get_weights()):
            results[f"{name}_w{i}"] = w
        results[f"{name}_iterations"] = int(
            keras.ops.convert_to_numpy(optimizer.iterations)
        )
        results[f"{name}_micro_steps"] = int(
            keras.ops.convert_to_numpy(optimizer.micro_steps)
        )
    return results


def skip_on_every_rank(rank, x, y):
    """`skip_nonfinite` under `sync_windows`: rank 1's gradients are NaN
    on micro-step `SKIPPED`; both ranks must leave it out (keys `skip_*`)."""
    model = small_model(0)
    optimizer = sync_windows(
        AdamAccumulate(learning_rate=0.01, accum_iters=K, skip_nonfinite=True)
    )
    variables = model.trainable_variables
    for step in range(K + 1):
        lo = step * GLOBAL_MICRO + rank * B
        xb = torch.from_numpy(x[lo : lo + B])
        yb = torch.from_numpy(y[lo : lo + B])
        loss = torch.mean(torch.square(model(xb) - yb))
        if step == SKIPPED and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        grads = [v.value.grad for v in variables]
        with torch.no_grad():
            optimizer.apply(grads, variables)
        model.zero_grad()
    results = {f"skip_w{i}": w for i, w in enumerate(model.get_weights())}
    for name in ("iterations", "skipped_micro_batches", "micro_steps"):
        results[f"skip_{name}"] = int(
            keras.ops.convert_to_numpy(getattr(optimizer, name))
        )
    return results


# The micro-step whose gradients are NaN on rank 1 (`skip_on_every_rank`).
SKIPPED = 1


def noise_gradients(rank, step):
    """`(grads, weight)` of micro-step `step` on `rank` for
    `noise_scale_across_ranks`: numpy draws, a weight per micro-batch."""
    rng = np.random.default_rng(100 * rank + step)
    model = small_model(0)
    grads = [
        (0.5 + rng.normal(size=tuple(v.shape))).astype("float32")
        for v in model.trainable_variables
    ]
    return grads, float(1 + (rank + 2 * step) % 5)


def noise_scale_across_ranks(rank):
    """`measure_noise_scale` under `sync_windows`: each rank's micro-batch
    is a small batch, the window over every rank the big one (keys
    `noise_*`)."""
    model = small_model(0)
    optimizer = sync_windows(
        SGDAccumulate(
            learning_rate=0.01, accum_iters=K, measure_noise_scale=True
        )
    )
    variables = model.trainable_variables
    for step in range(K):
        grads, weight = noise_gradients(rank, step)
        optimizer.apply(
            [torch.from_numpy(g) for g in grads], variables, weight=weight
        )
    return {
        f"noise_{name}": float(
            keras.ops.convert_to_numpy(getattr(optimizer, name))
        )
        for name in ("window_gradient_sq_norm", "window_noise_trace")
    }


def main(out):
    assert keras.backend.backend() == "torch"
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo",
        init_method=os.environ.get("ACCUM_INIT_METHOD", "env://"),
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        assert dist.get_world_size() == WORLD_SIZE
        x, y = regression_data(DATA_SEED, N)
        results = {"rank": rank, "world_size": dist.get_world_size()}
        for case in CASES:
            results.update(train(case, rank, x, y))
            results.update(train(case, rank, x, y, windows=True))
        results.update(flush_partial_windows(rank, x, y))
        results.update(skip_on_every_rank(rank, x, y))
        results.update(noise_scale_across_ranks(rank))
        np.savez(Path(out) / f"rank{rank}.npz", **results)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
