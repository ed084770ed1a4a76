"""What the window counts and measures, read from outside: the window
size now, its pending micro-steps, the counts since creation, the samples
seen and the last window's own metrics; and `regroup_window`, the pending
count re-cut (`fit_to_memory`)."""

import numpy as np
from keras import ops

from accum_optimizers import schedules


class WindowCounts:
    """The window's counts and metrics (a mixin of `GradientAccumulation`).

    Each reads `0` (or the parent's own count) where the optimizer has no
    window: `accum_iters=1`, or not built yet.
    """

    @property
    def _accum_schedule(self):
        """The `AccumSchedule` `accum_iters` stands for, or `None` for a
        constant window size."""
        if isinstance(self.accum_iters, dict):
            return schedules.PiecewiseConstantAccumIters(self.accum_iters)
        if isinstance(self.accum_iters, schedules.AccumSchedule):
            return self.accum_iters
        return None

    def _accum_window_size(self, key=None):
        """`k` for the window that produces the next update: an int, or an
        int32 tensor under a schedule. `key` is what the schedule is
        keyed on, applied updates (or samples seen, for `by_samples`);
        defaults to the optimizer's own count."""
        schedule = self._accum_schedule
        if schedule is None:
            return self.accum_iters
        if key is None:
            key = self._accum_schedule_key(schedule)
        return ops.cast(schedule(key), "int32")

    def _accum_schedule_key(self, schedule):
        """The optimizer's count `schedule` is keyed on: `iterations`, or
        `samples_seen` (float32) for `by_samples`, the noise scale
        measured for `by_noise_scale`."""
        if schedules.keyed_on_noise_scale(schedule):
            return self._accum_noise_key(schedule)
        if not schedules.keyed_on_samples(schedule):
            return self._iterations.value
        return self._accum_samples()

    def _accum_samples(self):
        """`samples_seen` of a built accumulating optimizer (0 before)."""
        if not self.built or not self._has_window:
            return ops.convert_to_tensor(0.0, "float32")
        return ops.add(
            self._accum_samples_seen.value,
            self._accum_samples_seen_error.value,
        )

    @property
    def current_accum_iters(self):
        """The window size now, as a Python int (`accum_iters`, or the
        schedule's value at the current number of applied updates)."""
        return int(ops.convert_to_numpy(self._accum_window_size()))

    @property
    def micro_steps(self):
        """Micro-batches held in the pending window, `0..accum_iters - 1`.

        Always `0` with `accum_iters=1`. `iterations` counts applied updates.
        """
        if not self._has_window or not self.built:
            return ops.zeros((), dtype="int32")
        return ops.convert_to_tensor(self._accum_micro_steps)

    @property
    def micro_batches_seen(self):
        """Micro-batches (`apply` calls) accumulated since creation.

        Micro-steps dropped by a `LossScaleOptimizer` for non-finite
        gradients never reach this optimizer and are not counted.
        """
        if not self._has_window or not self.built:
            return self.iterations
        return ops.convert_to_tensor(self._accum_micro_batches)

    @property
    def skipped_micro_batches(self):
        """Micro-batches left out of their window because their gradients
        were not finite (`skip_nonfinite=True`), since creation."""
        if not self._has_window or not self.built:
            return ops.zeros((), dtype="int32")
        return ops.convert_to_tensor(self._accum_skipped)

    @property
    def samples_seen(self):
        """The total weight of the applied windows, as a float32 scalar:
        samples (or tokens, or sample weights) when windows are weighted
        (`weigh_micro_batches`, `apply(..., weight=)`), micro-batches
        otherwise. `by_samples` schedules are keyed on it; a pending
        window is not counted until it is applied."""
        if not self._has_window or not self.built:
            return ops.cast(self.iterations, "float32")
        return self._accum_samples()

    @property
    def window_loss(self):
        """The loss of the last applied window: the mean of its
        micro-batches' losses, weighed as their gradients are, which is the
        big batch's loss at the window's weights. `fit` hands each
        micro-batch's loss to the optimizer; a custom loop passes
        `apply(..., loss=)`. NaN where a micro-batch of the window came
        without its loss; `0` before the first update."""
        if not self._has_window or not self.built:
            return ops.zeros((), dtype="float32")
        return ops.convert_to_tensor(self._accum_window_loss)

    @property
    def window_grad_norm(self):
        """The global norm of the last applied window's mean gradient (before
        clipping): the big batch's gradient norm. `0` before the first
        update; infinite where the window's weighted sums square past
        float32's range (weights times gradients above about 1e19)."""
        if not self._has_window or not self.built:
            return ops.zeros((), dtype="float32")
        return ops.convert_to_tensor(self._accum_window_grad_norm)

    @property
    def last_apply_updated(self):
        """Whether the last `apply` (or `flush`) updated the weights."""
        if not self._has_window:
            return ops.greater(self.iterations, 0)
        if not self.built:
            return ops.convert_to_tensor(False)
        return ops.logical_and(
            ops.equal(self._accum_micro_steps.value, 0),
            ops.greater(self._accum_micro_batches.value, 0),
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
    optimizer._accum_micro_steps.assign(np.array(micro_steps, "int32"))
