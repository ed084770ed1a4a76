"""What `fit_to_memory` needs to recover from an out-of-memory error: where
training is (`Tracker`), whether the failed step can be retried exactly,
and the pending window re-cut at the new micro-batch."""

import keras
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers._backend import COUNTS_ITERATIONS_BEFORE_UPDATE
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


def _commits(optimizers):
    """Each optimizer's count of `apply` calls it committed: micro-batches
    added and skipped."""
    return [
        int(ops.convert_to_numpy(optimizer.micro_batches_seen))
        + int(ops.convert_to_numpy(optimizer.skipped_micro_batches))
        for optimizer in optimizers
    ]


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
        self._commits = None

    def begin(self, batches):
        self._batches = batches
        self.in_step = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self._batches.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.position = self._batches.bounds[batch][0]
        if self.position % self._target == 0:
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
            self._commits = _commits(self._optimizers)

    def check_recoverable(self, error):
        """Raises, naming what happened, unless the failed step left the
        optimizers as they were before it and the pending window is the
        one the plan's samples make (so that retrying its samples at a
        smaller micro-batch is exact)."""
        if self._commits is not None and _commits(self._optimizers) != (
            self._commits
        ):
            raise RuntimeError(
                "fit_to_memory: the device ran out of memory after the "
                "train step had begun to write the optimizer's state (in "
                "the window's update): the step cannot be undone, so "
                "training cannot continue exactly. The model and optimizer "
                "hold what the step wrote; restore them from a checkpoint "
                "and call fit_to_memory with a smaller micro_batch_size. "
                f"The error: {error!r}"
            ) from error
        pending = [
            int(ops.convert_to_numpy(optimizer.micro_steps))
            for optimizer in self._optimizers
        ]
        if any(count != self.window_steps for count in pending):
            raise RuntimeError(
                "fit_to_memory: the device ran out of memory in a window "
                "that a skipped micro-batch regrouped (`skip_nonfinite`, "
                "or a LossScaleOptimizer's skip of non-finite gradients): "
                f"it holds {pending[0]} micro-batches where the plan's "
                f"samples make {self.window_steps}, so the window cannot be "
                "re-cut at a smaller micro-batch exactly. The model and "
                "optimizer are as they were before the failed step; call "
                "fit_to_memory with a smaller micro_batch_size. The error: "
                f"{error!r}"
            ) from error

    def on_train_batch_end(self, batch, logs=None):
        self.in_step = False
        self.window_steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self.logs[epoch] = dict(logs or {})
