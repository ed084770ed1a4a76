"""What `fit_to_memory` needs to recover from an out-of-memory error: where
training is (`Tracker`), whether the failed step can be retried exactly,
and the pending window re-cut at the new micro-batch."""

import keras
import numpy as np
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers._backend import COUNTS_ITERATIONS_BEFORE_UPDATE
from accum_optimizers._backend import FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS
from accum_optimizers._backend import FAILED_STEP_WRITES_NO_STATE
from accum_optimizers._backend import is_out_of_memory
from accum_optimizers._window.counts import regroup_window


def continue_window(optimizers, plan, position):
    """The pending window's micro-step count at the new micro-batch size:
    what closes it after the micro-batches its remaining samples need.
    The sums and total weight stay: the window is weighted."""
    done = position % plan.target_batch_size
    remaining = -(-(plan.target_batch_size - done) // plan.micro_batch_size)
    micro_steps = plan.accum_iters - remaining if done else 0
    for optimizer in optimizers:
        regroup_window(optimizer, micro_steps)
    return micro_steps


def fit_until_out_of_memory(model, batches, **kwargs):
    """Runs `model.fit(batches, ...)`; returns the out-of-memory error that
    ended it, or `None`."""
    try:
        model.fit(batches, shuffle=False, **kwargs)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        return error
    return None


def _counts(optimizers):
    """Each optimizer's `(micro_batches_seen, skipped_micro_batches,
    micro_steps)`: its `apply` calls committed (added, skipped), and the
    pending window's micro-steps."""
    return [
        tuple(
            int(ops.convert_to_numpy(count))
            for count in (
                optimizer.micro_batches_seen,
                optimizer.skipped_micro_batches,
                optimizer.micro_steps,
            )
        )
        for optimizer in optimizers
    ]


def _restore_counts(optimizers, counts):
    """Puts back each optimizer's committed counts (`_counts`) and empties
    its pending window, whose next micro-step overwrites the sums."""
    for optimizer, (added, skipped, _) in zip(optimizers, counts):
        window = optimizer._window
        window.micro_batches.assign(np.array(added, "int32"))
        window.skipped.assign(np.array(skipped, "int32"))
        window.micro_steps.assign(np.zeros((), "int32"))


class Tracker(keras.callbacks.Callback):
    """Where training is: the epoch, the first sample of the micro-batch
    being trained, the micro-steps the pending window has taken, and each
    finished epoch's logs; and whether a failed step can be retried.

    Args:
        optimizers: the model's accumulating optimizers.
        target: the target batch size, the samples of a window.
    """

    def __init__(self, optimizers, target):
        super().__init__()
        self.logs = {}
        self.epoch = 0
        self.position = 0
        self.iterations = None
        self.window_steps = 0
        self._optimizers = optimizers
        self._target = target
        self._batches = None
        self._before = None
        self._window_start = None

    def begin(self, batches):
        self._batches = batches
        self.in_step = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self._batches.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.position = self._batches.bounds[batch][0]
        starts_window = self.position % self._target == 0
        if starts_window:
            self.window_steps = 0
        self.in_step = True
        model = self.model
        self.iterations = None
        if COUNTS_ITERATIONS_BEFORE_UPDATE and not all(
            optimizer._has_window for optimizer in self._optimizers
        ):
            # The parent optimizer (on TensorFlow) adds 1 to `iterations`
            # without waiting for the step's gradients: a step that fails
            # may have counted an update it did not apply.
            self.iterations = [
                int(ops.convert_to_numpy(optimizer.iterations))
                for optimizer in self._optimizers
            ]
        if FAILED_STEP_WRITES_NO_STATE:
            if _keras_private.jax_fit_takes_state_from_variables(model):
                # If the step fails, `fit` puts back a state it holds: an
                # older one (a probe's, or the epoch's before its flush) or
                # none. The state is the variables'.
                _keras_private.set_jax_state_to_variables(model)
        else:
            # A JAX step writes all of its state or none; a TensorFlow or
            # torch step that fails may have written part of it.
            self._before = _counts(self._optimizers)
            if starts_window:
                self._window_start = self._before

    def check_recoverable(self, error):
        """Raises, naming what happened, unless the failed step can be
        retried exactly; returns whether training goes on from the pending
        window's first sample (else from the failed step's).

        The pending window must be the one the plan's samples make. A step
        that wrote nothing is retried, the pending window kept: a JAX step
        writes all of its state or none, and a torch step counts its
        micro-batch before it writes. A step that wrote part of its window
        leaves the weights as they were (the window's update waits for its
        count of micro-batches; a TensorFlow graph adds each gradient as
        the backward pass produces it, and counts the micro-batch once
        every gradient exists): the window is emptied, its counts put back
        as they were at its first micro-batch, and its samples trained
        again. Where the count moved in the step that closes the window,
        the update may have begun, which cannot be undone."""
        if self._before is None:  # A JAX step: its state was put back.
            pending = [
                int(ops.convert_to_numpy(optimizer.micro_steps))
                for optimizer in self._optimizers
            ]
            self._check_not_regrouped(pending, error)
            return False
        before = self._before
        self._check_not_regrouped([counts[2] for counts in before], error)
        after = _counts(self._optimizers)
        counted = [a[0] != b[0] for a, b in zip(after, before)]
        if any(
            moved and counts[2] + 1 >= optimizer.accum_iters
            for optimizer, counts, moved in zip(
                self._optimizers, before, counted
            )
        ):
            raise RuntimeError(
                "fit_to_memory: the device ran out of memory after the "
                "train step that closes a window had begun to write the "
                "optimizer's state (the window's update): the step cannot "
                "be undone, so training cannot continue exactly. The model "
                "and optimizer hold what the step wrote; restore them from "
                "a checkpoint and call fit_to_memory with a smaller "
                f"micro_batch_size. The error: {error!r}"
            ) from error
        if not any(counted) and not FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS:
            return False
        _restore_counts(self._optimizers, self._window_start)
        return True

    def _check_not_regrouped(self, pending, error):
        """Raises unless each optimizer's pending window holds `pending`
        micro-steps where the plan's samples make `window_steps`."""
        if all(count == self.window_steps for count in pending):
            return
        if FAILED_STEP_WRITES_NO_STATE:
            state = (
                "The model and optimizer are as they were before the failed "
                "step; call fit_to_memory with a smaller micro_batch_size."
            )
        else:
            state = (
                "The weights are as they were before the failed step, but "
                "the pending window may hold part of it: restore the model "
                "and optimizer from a checkpoint and call fit_to_memory "
                "with a smaller micro_batch_size."
            )
        raise RuntimeError(
            "fit_to_memory: the device ran out of memory in a window that a "
            "skipped micro-batch regrouped (`skip_nonfinite`, or a "
            "LossScaleOptimizer's skip of non-finite gradients): it holds "
            f"{pending[0]} micro-batches where the plan's samples make "
            f"{self.window_steps}, so the window cannot be re-cut at a "
            f"smaller micro-batch exactly. {state} The error: {error!r}"
        ) from error

    def on_train_batch_end(self, batch, logs=None):
        self.in_step = False
        self.window_steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self.logs[epoch] = dict(logs or {})
