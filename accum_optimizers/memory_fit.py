"""Fit the batch to the memory: a target batch, the largest micro-batch
that fits, and recovery from out-of-memory errors.

`fit_to_memory(model, x, y, target_batch_size=T)` trains like the parent
optimizer with `batch_size=T`: each window of `accum_iters` micro-batches
is one big batch of `T` consecutive samples (the epoch's last one shorter,
applied at the epoch's end, as the parent's short last batch). The
micro-batch `b` is the largest that fits; the window of `T` samples is cut
into micro-batches of `b`, its last one shorter where `b` does not divide
`T`, so `accum_iters = ceil(T / b)`. Micro-batches are weighed by their
loss's count (`weigh_micro_batches`): a window's update is the big batch's
mean gradient whatever the micro-batches' sizes.

`b` comes from a plan (`plan_micro_batch`): the smallest window size `k`
(`b = ceil(T / k)`) whose train step fits, found by doubling `k` and then
bisecting. With a `memory_limit`, JAX compiles the train step for each
candidate and reads its peak from XLA's memory analysis, without running
it (on the CPU too). Without one, each candidate runs one real train step,
the window's last (the update included), from a copy of the state on the
host, which is put back after: a step that raises the backend's
out-of-memory error means "does not fit".

When a train step runs out of memory later, `b` is halved and the epoch
continues from the first sample the failed step held: the pending window
keeps its sums and total weight; only its count of micro-steps changes,
to what the window's remaining samples need at the new size (double, for
an even `b` that divides `T`). Where the failed step wrote part of the
window (a TensorFlow graph adds each gradient as the backward pass
produces it), the window starts again from its first sample instead
(`_recovery.Tracker.check_recoverable`).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence

import keras
import numpy as np

from accum_optimizers._inner import accumulating_optimizers
from accum_optimizers._memory import free_memory
from accum_optimizers._micro_batches import EpochOrder
from accum_optimizers._micro_batches import MicroBatches
from accum_optimizers._micro_batches import arrays
from accum_optimizers._micro_batches import sample_count
from accum_optimizers._planning import MicroBatchPlan
from accum_optimizers._planning import non_negative_int
from accum_optimizers._planning import plan_micro_batch
from accum_optimizers._planning import set_window
from accum_optimizers._recovery import Tracker
from accum_optimizers._recovery import continue_window
from accum_optimizers._recovery import fit_until_out_of_memory
from accum_optimizers.callbacks import FlushAccumulation

__all__ = ["MicroBatchPlan", "fit_to_memory", "plan_micro_batch"]


def fit_to_memory(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    target_batch_size: int,
    epochs: int = 1,
    sample_weight: Any = None,
    memory_limit: int | str | None = None,
    micro_batch_size: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    validation_data: tuple[Any, ...] | None = None,
    verbose: str | int = "auto",
    initial_epoch: int = 0,
) -> keras.callbacks.History:
    """Trains at a target batch with the largest micro-batch that fits,
    exactly like the parent optimizer with `batch_size=target_batch_size`.

    Plans the micro-batch (`plan_micro_batch`, unless one is given), then
    runs `model.fit` over windows of `target_batch_size` consecutive
    samples, each cut into micro-batches (its last one shorter where the
    micro-batch does not divide the target), and applies the epoch's short
    last window at the epoch's end. When a train step runs out of device
    memory (TensorFlow's `ResourceExhaustedError`, JAX's
    `RESOURCE_EXHAUSTED` runtime error, torch's `OutOfMemoryError`), the
    micro-batch is halved, `accum_iters` raised to match, and training
    continues from the failed micro-batch's first sample, with the
    pending window and the epoch's order kept (on TensorFlow, whose
    failed step may have added part of its gradients, from the pending
    window's first sample, the window emptied); any other error
    propagates.

    Callbacks see one `fit` from the start, and a new one from each
    recovery (`on_train_begin` again); the recovered epoch's logs cover
    its part after the recovery. Returns the `History` of every epoch,
    with the plan as `history.plan`.

    Args:
        model: a compiled `keras.Model` whose optimizer accumulates (see
            `plan_micro_batch`), with `steps_per_execution=1`.
        x: the inputs: a numpy array, or a list, tuple or dict of them
            (backend tensors are copied to numpy). Datasets, generators
            and `PyDataset`s are refused: recovery needs to re-cut the
            epoch's samples.
        y: the targets, structured like `x`, or `None`.
        target_batch_size: Integer >= 1, the batch size the training
            stands for.
        epochs: Integer, the epoch to end at (as `fit`'s). Defaults to
            `1`.
        sample_weight: Optional array of per-sample weights.
        memory_limit: Optional bytes to plan against (JAX; see
            `plan_micro_batch`). Defaults to `None`.
        micro_batch_size: Optional micro-batch to start from, without
            planning. Defaults to `None`.
        shuffle: Boolean. Shuffle the samples before each epoch, with a
            permutation drawn from `seed` and the epoch's number (the
            same after a recovery). Defaults to `True`.
        seed: Optional integer seed of the permutations. Defaults to
            `None`: `0`.
        callbacks: Optional list of Keras callbacks. A
            `FlushAccumulation` is added unless the list holds one (which
            must flush every epoch).
        validation_data: Optional `(x_val, y_val)` or `(x_val, y_val,
            sample_weight_val)`, evaluated at each epoch's end at the
            micro-batch size.
        verbose: `"auto"`, 0, 1 or 2, as `fit`'s; above 0 it also prints
            the plan and each recovery. Defaults to `"auto"`.
        initial_epoch: Integer, the epoch to start at. Defaults to `0`.

    Returns:
        A `keras.callbacks.History`, with a `plan` attribute: the
        `MicroBatchPlan`, whose `micro_batch_size` is the one training
        ended with and whose `recoveries` lists the recoveries.

    Raises:
        TypeError: if `shuffle` is not a bool, or an argument
            `plan_micro_batch` checks is of the wrong type.
        ValueError: an argument that cannot be trained with
            (`steps_per_execution` other than 1, a dataset for `x`, a
            `FlushAccumulation` that does not flush every epoch), named
            with its value.
        MemoryError: if not even a micro-batch of 1 sample fits.
    """
    epochs = non_negative_int("epochs", epochs)
    initial_epoch = non_negative_int("initial_epoch", initial_epoch)
    if not isinstance(shuffle, bool):
        raise TypeError(f"`shuffle` must be a bool. Received: {shuffle!r}")
    seed = 0 if seed is None else non_negative_int("seed", seed)
    if getattr(model, "steps_per_execution", 1) != 1:
        raise ValueError(
            "fit_to_memory needs `steps_per_execution=1` in `compile`: an "
            "out-of-memory error inside a multi-step execution leaves the "
            "steps before it applied and unaccounted for. Received: "
            f"steps_per_execution={model.steps_per_execution}"
        )
    data = arrays(x, y, sample_weight)
    plan = plan_micro_batch(
        model,
        data[0],
        data[1],
        target_batch_size=target_batch_size,
        sample_weight=data[2],
        memory_limit=memory_limit,
        micro_batch_size=micro_batch_size,
    )
    printing = verbose != 0
    if printing:
        print(f"fit_to_memory: {plan}")
    optimizers = accumulating_optimizers(model.optimizer)
    order = EpochOrder(sample_count(data), shuffle, seed)
    tracker = Tracker(optimizers, plan.target_batch_size)
    callbacks = [tracker] + _with_flush(callbacks)
    epoch, start = initial_epoch, 0
    model.stop_training = False
    while epoch < epochs and not model.stop_training:
        batches = MicroBatches(
            data,
            order,
            plan.target_batch_size,
            plan.micro_batch_size,
            start,
        )
        tracker.begin(batches)
        # A resumed epoch is its own `fit`; the ones after it, another.
        end = epoch + 1 if start else epochs
        error = fit_until_out_of_memory(
            model,
            batches,
            epochs=end,
            initial_epoch=epoch,
            callbacks=callbacks,
            validation_data=validation_data,
            validation_batch_size=plan.micro_batch_size,
            verbose=verbose,
        )
        if error is None:
            epoch, start = end, 0
            continue
        epoch, failed_at = tracker.epoch, tracker.position
        if tracker.iterations is not None:
            for optimizer, count in zip(optimizers, tracker.iterations):
                optimizer.iterations.assign(np.array(count, "int64"))
        size = plan.micro_batch_size
        if size == 1 or not tracker.in_step:
            # Nothing smaller to try, or not a train step's (validation's):
            # the epoch's training already ended.
            raise error
        start = failed_at
        if tracker.check_recoverable(error):
            start -= start % plan.target_batch_size  # The window's first.
        del error  # its traceback holds the failed step's buffers
        free_memory(model)
        new_size = -(-size // 2)
        plan.recoveries.append((epoch, failed_at, size, new_size))
        plan.micro_batch_size = new_size
        set_window(model, optimizers, plan.target_batch_size, new_size)
        tracker.window_steps = continue_window(optimizers, plan, start)
        if printing:
            print(
                f"fit_to_memory: out of memory at micro-batch {size} (epoch "
                f"{epoch + 1}, sample {failed_at}); continuing from sample "
                f"{start} with micro-batch {new_size} x accum_iters "
                f"{plan.accum_iters}"
            )
    history = keras.callbacks.History()
    history.set_model(model)
    history.epoch = sorted(tracker.logs)
    history.history = {}
    for number in history.epoch:
        for key, value in tracker.logs[number].items():
            history.history.setdefault(key, []).append(value)
    history.plan = plan
    model.history = history
    return history


# -- Checks -----------------------------------------------------------------


def _with_flush(
    callbacks: Sequence[keras.callbacks.Callback] | None,
) -> list[keras.callbacks.Callback]:
    """`callbacks` with a `FlushAccumulation` that flushes every epoch: the
    epoch's short last window is the parent's short last batch."""
    callbacks = list(callbacks or [])
    flushes = [c for c in callbacks if isinstance(c, FlushAccumulation)]
    for flush in flushes:
        if not flush.every_epoch:
            raise ValueError(
                "fit_to_memory applies each epoch's short last window at "
                "the epoch's end, as the parent applies its short last "
                "batch. Received: FlushAccumulation(every_epoch=False)"
            )
    return callbacks if flushes else [FlushAccumulation()] + callbacks
