"""What the window counts, read from outside: the window size now, the
counts since creation and the samples seen; and `regroup_window`, the
pending count re-cut (`fit_to_memory`). Each reads `0` (or the parent's
own count) where the optimizer has no window: `accum_iters=1`, or not
built yet."""

import numpy as np
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers import schedules
from accum_optimizers._validation import concrete_value
from accum_optimizers._window import noise


def schedule_of(accum_iters):
    """The `AccumSchedule` `accum_iters` stands for, or `None` for a
    constant window size."""
    if isinstance(accum_iters, dict):
        return schedules.PiecewiseConstantAccumIters(accum_iters)
    if isinstance(accum_iters, schedules.AccumSchedule):
        return accum_iters
    return None


def window_size(optimizer, key=None):
    """`k` for the window that produces the next update: an int, or an
    int32 tensor under a schedule. `key` is what the schedule is keyed on
    (applied updates, samples seen, the noise scale); defaults to the
    optimizer's own count."""
    schedule = optimizer._accum_schedule
    if schedule is None:
        return optimizer.accum_iters
    if key is None:
        if schedules.keyed_on_noise_scale(schedule):
            key = noise.schedule_key(optimizer, schedule)
        elif schedules.keyed_on_samples(schedule):
            key = samples(optimizer)
        else:
            key = _keras_private.iterations_variable(optimizer).value
    return ops.cast(schedule(key), "int32")


def samples(optimizer):
    """`samples_seen` of a built accumulating optimizer (0 before)."""
    if not optimizer.built or not optimizer._has_window:
        return ops.convert_to_tensor(0.0, "float32")
    return optimizer._window.samples()


def read(optimizer, variable_of, without_window):
    """`variable_of(window)`, a window variable, as a tensor; or
    `without_window()` where the optimizer keeps no window (yet)."""
    if not optimizer._has_window or not optimizer.built:
        return without_window()
    return ops.convert_to_tensor(variable_of(optimizer._window))


def last_apply_updated(optimizer):
    """Whether the last `apply` (or `flush`) updated the weights."""
    if not optimizer._has_window:
        return ops.greater(optimizer.iterations, 0)
    if not optimizer.built:
        return ops.convert_to_tensor(False)
    window = optimizer._window
    return ops.logical_and(
        ops.equal(window.micro_steps.value, 0),
        ops.greater(window.micro_batches.value, 0),
    )


def regroup_window(optimizer, micro_steps):
    """Makes `optimizer`'s pending window count `micro_steps` micro-steps,
    eagerly, keeping its sums and total weight: it closes after
    `accum_iters - micro_steps` more micro-batches.

    The window's update is its sums over its total weight, however many
    micro-batches brought them, so a window re-cut at another micro-batch
    size stays exact: `fit_to_memory` continues one at a smaller
    micro-batch, and its probe makes the next step close one (then puts
    every variable back).

    Args:
        optimizer: a built accumulating optimizer with a window.
        micro_steps: Integer, `0 <= micro_steps < accum_iters`; `0` only
            where the window holds no micro-batch.
    """
    optimizer._window.micro_steps.assign(np.array(micro_steps, "int32"))


def add_compensated(total, error, added):
    """The writes (`(variable, value)` pairs) of `total += added` for a
    float32 pair of variables whose sum stays exact (Knuth's two-sum, the
    lost low bits kept in `error`), where a float32 total stops counting
    small additions past 2**24."""
    operands = (total.value, error.value, added)
    known = [concrete_value(value) for value in operands]
    if all(value is not None for value in known):
        # Eagerly, on the host in float32 (the two-sum's rounding is
        # float32's), where each `keras.ops` call is a dispatch or more.
        operands = [np.float32(value) for value in known]
    before, lost_before, added = operands
    after = before + added
    kept = after - before
    lost = (before - (after - kept)) + (added - kept)
    return [(total, after), (error, lost_before + lost)]
