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
from accum_optimizers import schedules
from accum_optimizers.torch_distributed import sync_windows
from accum_optimizers.torch_distributed import weigh_next_backward

K, B, WORLD_SIZE, WINDOWS = 3, 4, 2, 2
GLOBAL_MICRO = B * WORLD_SIZE
N = WINDOWS * K * GLOBAL_MICRO
DATA_SEED = 5
WAYS = ("every_step", "windows", "overlap")
# With the overlap, buckets of 104 bytes: the small model's sums, last
# variable first (8, 48, 24 and 96 bytes), make 2 buckets.
OVERLAP_BUCKET_MB = 104 / 2**20
OVERLAP_BUCKETS = 2
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


def rows(x, y, start, rank):
    """Rank `rank`'s `B` rows of the global micro-batch from `start`, as
    torch tensors."""
    lo = start + rank * B
    return torch.from_numpy(x[lo : lo + B]), torch.from_numpy(y[lo : lo + B])


def mse(model, xb, yb):
    return torch.mean(torch.square(model(xb) - yb))


def apply_grads(model, optimizer, **kwargs):
    """Hands the `.grad` of every Keras variable's torch `Parameter` to
    `optimizer.apply` (with `kwargs`), under `torch.no_grad()` as Keras'
    own torch trainer does, then zeroes them."""
    variables = model.trainable_variables
    grads = [v.value.grad for v in variables]
    with torch.no_grad():
        optimizer.apply(grads, variables, **kwargs)
    model.zero_grad()


def weights(prefix, model):
    """`model`'s weights, keyed `{prefix}_w{i}`."""
    return {f"{prefix}_w{i}": w for i, w in enumerate(model.get_weights())}


def train(case, rank, x, y, way="every_step"):
    """Trains one case, one `way` (keys suffixed `_{way}`, none for
    `every_step`): `every_step`, plain DDP; `windows`, micro-steps under
    `no_sync()` and the optimizer under `sync_windows`; `overlap`, the
    same with `sync_windows(model=)` (the exchange in the last backward).
    Under `sync_windows` the all-reduces are counted over the whole loop,
    backward passes included."""
    optimizer_class, kwargs = CASES[case]
    model = small_model(0)
    ddp = DistributedDataParallel(model)
    state = {"reductions": 0, "all_reduces": 0, "in_backward": 0}
    ddp.register_comm_hook(state, counting_allreduce)
    optimizer = optimizer_class(accum_iters=K, **kwargs)
    windows = way != "every_step"
    if windows:
        if way == "overlap":
            sync_windows(
                optimizer, model=model, bucket_cap_mb=OVERLAP_BUCKET_MB
            )
        else:
            sync_windows(optimizer)
    variables = model.trainable_variables
    counted = counting_all_reduces(state) if windows else None
    with counted or contextlib.nullcontext():
        for start in range(0, N, GLOBAL_MICRO):
            lo = start + rank * B
            xb = torch.from_numpy(x[lo : lo + B])
            yb = torch.from_numpy(y[lo : lo + B])
            before = state["all_reduces"]
            with ddp.no_sync() if windows else contextlib.nullcontext():
                loss = torch.mean(torch.square(ddp(xb) - yb))
                loss.backward()  # without no_sync, DDP averages them
            state["in_backward"] += state["all_reduces"] - before
            # A Keras torch variable's `.value` is its `torch.nn.Parameter`.
            grads = [v.value.grad for v in variables]
            with torch.no_grad():
                if windows:
                    optimizer.apply(grads, variables)
                else:
                    with counting_all_reduces(state):
                        optimizer.apply(grads, variables)
            ddp.zero_grad()
    case = case if way == "every_step" else f"{case}_{way}"
    results = weights(case, model)
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
    results[f"{case}_all_reduces_in_backward"] = state["in_backward"]
    return results


def flush_partial_windows(rank, x, y, overlap=False):
    """`flush` under `sync_windows`: a partial window of 2 micro-steps
    (keys `flush_*`), then one whose micro-batch on rank 1 is NaN (keys
    `flush_nan_*`: every rank must discard it, none left waiting). With
    `overlap`, under `sync_windows(model=)`, and the first `flush` after
    the backward of a third micro-step (keys `overlap_flush*`)."""
    model = small_model(0)
    optimizer = sync_windows(
        SGDAccumulate(learning_rate=0.1, accum_iters=K),
        model=model if overlap else None,
    )
    results = {}
    prefix = "overlap_" if overlap else ""
    for name, steps, poisoned in (("flush", 2, False), ("flush_nan", 1, True)):
        name = prefix + name
        for step in range(steps):
            loss = mse(model, *rows(x, y, step * GLOBAL_MICRO, rank))
            if poisoned and rank == 1:
                loss = loss * float("nan")
            loss.backward()
            apply_grads(model, optimizer)
        if overlap and not poisoned:
            # A backward that would close the window, whose exchange starts,
            # then `flush` instead of its `apply`: the exchange is dropped
            # and the 2 micro-steps are applied.
            mse(model, *rows(x, y, 2 * GLOBAL_MICRO, rank)).backward()
            model.zero_grad()
        optimizer.flush()
        results.update(weights(name, model))
        results[f"{name}_iterations"] = int(
            keras.ops.convert_to_numpy(optimizer.iterations)
        )
        results[f"{name}_micro_steps"] = int(
            keras.ops.convert_to_numpy(optimizer.micro_steps)
        )
    return results


def skip_on_every_rank(rank, x, y, skipped=None, overlap=False):
    """`skip_nonfinite` under `sync_windows`: rank 1's gradients are NaN
    on micro-step `skipped` (default `SKIPPED`); both ranks must leave it
    out (keys `skip_*`). With `overlap`, under `sync_windows(model=)` and
    NaN on the window's last micro-step, `OVERLAP_SKIPPED`, whose
    finiteness is read in the reduced sums (keys `overlap_skip_*`)."""
    model = small_model(0)
    optimizer = sync_windows(
        AdamAccumulate(learning_rate=0.01, accum_iters=K, skip_nonfinite=True),
        model=model if overlap else None,
    )
    skipped = OVERLAP_SKIPPED if overlap else SKIPPED
    prefix = "overlap_skip" if overlap else "skip"
    for step in range(K + 1):
        loss = mse(model, *rows(x, y, step * GLOBAL_MICRO, rank))
        if step == skipped and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        apply_grads(model, optimizer)
    results = weights(prefix, model)
    for name in ("iterations", "skipped_micro_batches", "micro_steps"):
        results[f"{prefix}_{name}"] = int(
            keras.ops.convert_to_numpy(getattr(optimizer, name))
        )
    return results


# The micro-step whose gradients are NaN on rank 1 (`skip_on_every_rank`):
# mid-window, and with the overlap the window's last.
SKIPPED = 1
OVERLAP_SKIPPED = K - 1


def overlap_refusals(rank, x, y):
    """Under `sync_windows(model=)`, on the window's last micro-step:
    `apply` with gradients other than the backward's `.grad`, then with a
    `weight`, must raise and change nothing; the right call then closes
    the window (keys `refused_*`: the errors, and the weights and counters
    after it)."""
    model = small_model(0)
    optimizer = sync_windows(
        AdamAccumulate(learning_rate=0.01, accum_iters=K), model=model
    )
    variables = model.trainable_variables
    results = {}
    for step in range(K):
        lo = step * GLOBAL_MICRO + rank * B
        xb = torch.from_numpy(x[lo : lo + B])
        yb = torch.from_numpy(y[lo : lo + B])
        torch.mean(torch.square(model(xb) - yb)).backward()
        grads = [v.value.grad for v in variables]
        with torch.no_grad():
            for name in ("copies", "weight") if step == K - 1 else ():
                # Each refusal drops the backward's exchange: the backward
                # runs again for the next call.
                try:
                    if name == "copies":
                        optimizer.apply([g.clone() for g in grads], variables)
                    else:
                        optimizer.apply(grads, variables, weight=2.0)
                except ValueError as error:
                    results[f"refused_{name}"] = str(error)
                results[f"refused_{name}_micro_steps"] = int(
                    optimizer.micro_steps
                )
                model.zero_grad()
                with torch.enable_grad():
                    loss = torch.mean(torch.square(model(xb) - yb))
                    loss.backward()
                grads = [v.value.grad for v in variables]
            optimizer.apply(grads, variables)
        model.zero_grad()
    results.update(weights("refused", model))
    results["refused_iterations"] = int(optimizer.iterations)
    return results


# Weighted windows with the overlap: each global micro-batch of
# `GLOBAL_MICRO` split unevenly, `SHARES[r]` rows to rank r.
SHARES = (3, 5)


def weighted_overlap(rank, x, y):
    """`sync_windows(model=)` with uneven shards weighed by their sample
    counts: each rank's loss is the mean over its own rows, `apply` gets
    `weight=` the row count, announced before each backward
    (`weigh_next_backward`); the windows are the global batches of the
    `adam` case (keys `weighted_overlap_*`)."""
    optimizer_class, kwargs = CASES["adam"]
    model = small_model(0)
    optimizer = sync_windows(
        optimizer_class(accum_iters=K, **kwargs), model=model
    )
    share, offset = SHARES[rank], sum(SHARES[:rank])
    for start in range(0, N, GLOBAL_MICRO):
        lo = start + offset
        xb = torch.from_numpy(x[lo : lo + share])
        yb = torch.from_numpy(y[lo : lo + share])
        weigh_next_backward(optimizer, share)
        mse(model, xb, yb).backward()
        apply_grads(model, optimizer, weight=share)
    results = weights("weighted_overlap", model)
    results["weighted_overlap_iterations"] = int(optimizer.iterations)
    return results


MISSING_WINDOWS = 3
# Whole windows, then one micro-step that a flush applies.
MISSING_STEPS = MISSING_WINDOWS * K + 1
HEADS = "abc"
# The seeds of the drawn patterns of `reached_heads` (`TORCH_RANK_DRAWS`
# of them: 2 in CI, more for a local hunt).
DRAWS = tuple(range(int(os.environ.get("TORCH_RANK_DRAWS", "2"))))


def reached(pattern, rank, step):
    """The heads (indices into `HEADS`) in rank `rank`'s loss at micro-step
    `step` of `reached_heads`.

    `pattern` `"named"`: head `a` always; head `b` in window 1 on all but
    rank 0's last micro-step (the ranks' closing calls differ in their
    `None`s), in window 2 on rank 1's first micro-step alone (rank 0 never
    reaches it), in window 3 nowhere (left alone, Adam's moments too);
    head `c` never. An int: a seed, each head drawn with probability 1/2,
    at least one per micro-step.
    """
    if pattern == "named":
        window, micro_step = divmod(step, K)
        if window == 0:
            with_b = rank == 1 or micro_step != K - 1
        else:
            with_b = window == 1 and rank == 1 and micro_step == 0
        return {0, 1} if with_b else {0}
    rng = np.random.default_rng([pattern, rank, step])
    heads = {i for i in range(len(HEADS)) if rng.random() < 0.5}
    return heads or {int(rng.integers(len(HEADS)))}


def missing_rows(x, y, step, rank):
    """The rows of `reached_heads`' micro-step `step` on `rank`."""
    return rows(x, y, step * GLOBAL_MICRO % N, rank)


def heads_model(features):
    """The model of `reached_heads`: one dense head per `HEADS`, seeded."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    heads = [keras.layers.Dense(2, name=name)(inputs) for name in HEADS]
    return keras.Model(inputs, heads)


def heads_loss(model, xb, heads):
    """The sum of the mean squares of the `heads` outputs (indices)."""
    outputs = model(xb)
    return sum(torch.mean(torch.square(outputs[i])) for i in sorted(heads))


def reached_heads(rank, x, y, overlap, pattern):
    """A model of three heads that the ranks reach in different micro-steps
    (`reached`), weighted windows, one bucket per variable, a flushed
    partial window last; at the close or with the overlap (keys
    `reached_{pattern}_{way}_*`)."""
    model = heads_model(x.shape[1])
    optimizer = sync_windows(
        AdamAccumulate(learning_rate=0.01, accum_iters=K),
        model=model if overlap else None,
        bucket_cap_mb=1e-6,
    )
    for step in range(MISSING_STEPS):
        xb, _ = missing_rows(x, y, step, rank)
        loss = heads_loss(model, xb, reached(pattern, rank, step))
        if overlap:
            weigh_next_backward(optimizer, 2.0 + rank)
        loss.backward()
        apply_grads(model, optimizer, weight=2.0 + rank)
    optimizer.flush()  # the last, partial window
    prefix = f"reached_{pattern}_{'overlap' if overlap else 'windows'}"
    results = weights(prefix, model)
    results[f"{prefix}_iterations"] = int(optimizer.iterations)
    return results


NOISE_BASE_BATCH = 2.0  # AdaScale's base batch in `noise_scale_across_ranks`


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
    """`measure_noise_scale` under `sync_windows`, with an AdaScale
    learning rate (base batch `NOISE_BASE_BATCH`): each rank's micro-batch
    is a small batch, the window over every rank the big one (keys
    `noise_*`)."""
    model = small_model(0)
    optimizer = sync_windows(
        SGDAccumulate(
            learning_rate=schedules.adascale(
                0.01, base_batch_size=NOISE_BASE_BATCH
            ),
            accum_iters=K,
            measure_noise_scale=True,
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
        for name in (
            "window_gradient_sq_norm",
            "window_noise_trace",
            "adascale_gain",
            "scale_invariant_step",
        )
    }


# The scaling rules in `rules_across_ranks`, on the base schedule
# RULE_RATE * RULE_DECAY ** tau.
RULE_RATE, RULE_DECAY = 0.05, 0.8
RULE_WARMUP = 4.0  # linear_scaling's warm-up, in base steps
RULE_BASES = {"unweighted": 2.0, "weighted": 5.0}  # base_batch_size


def rules_across_ranks(rank):
    """A scaling rule under `sync_windows`, two windows each:
    `linear_scaling` with a warm-up, unweighted (each rank's micro-batch
    counts 1), and `sqrt_scaling`, weighted by `noise_gradients`' weights;
    the weights before and after each window and its `S` and `tau` (keys
    `rule_{unweighted,weighted}_*`)."""
    base = keras.optimizers.schedules.ExponentialDecay(
        RULE_RATE, decay_steps=1, decay_rate=RULE_DECAY
    )
    results = {}
    for kind, base_batch in RULE_BASES.items():
        weighted = kind == "weighted"
        if weighted:
            rate = schedules.sqrt_scaling(base, base_batch_size=base_batch)
        else:
            rate = schedules.linear_scaling(
                base, base_batch_size=base_batch, warmup_steps=RULE_WARMUP
            )
        model = small_model(0)
        optimizer = sync_windows(SGDAccumulate(rate, accum_iters=K))
        variables = model.trainable_variables
        weights = [model.get_weights()]
        scales, steps = [], []
        for step in range(2 * K):
            grads, weight = noise_gradients(rank, step)
            optimizer.apply(
                [torch.from_numpy(g) for g in grads],
                variables,
                weight=weight if weighted else None,
            )
            if step % K == K - 1:
                weights.append(model.get_weights())
                scales.append(float(optimizer.window_scale))
                steps.append(float(optimizer.scale_invariant_step))
        results[f"rule_{kind}_scales"] = np.asarray(scales)
        results[f"rule_{kind}_steps"] = np.asarray(steps)
        for w, window in enumerate(weights):
            for i, value in enumerate(window):
                results[f"rule_{kind}_w{w}_{i}"] = value
    return results


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
            for way in WAYS:
                results.update(train(case, rank, x, y, way))
        for overlap in (False, True):
            results.update(flush_partial_windows(rank, x, y, overlap))
            results.update(skip_on_every_rank(rank, x, y, overlap=overlap))
        results.update(overlap_refusals(rank, x, y))
        results.update(weighted_overlap(rank, x, y))
        for pattern in ("named",) + DRAWS:
            for overlap in (False, True):
                results.update(reached_heads(rank, x, y, overlap, pattern))
        results.update(noise_scale_across_ranks(rank))
        results.update(rules_across_ranks(rank))
        np.savez(Path(out) / f"rank{rank}.npz", **results)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
