"""The accumulation hooks, with the defaults most backends use.

`GradientAccumulation` (`_accumulation.py`) owns the counters, the checks and
the window's bookkeeping; for the work of one micro-step it calls the hooks
below, which a backend class (`tensorflow.py`, `jax.py`, `torch.py`)
overrides where its cheapest arrangement differs, as Keras' own
`TFOptimizer`, `JaxOptimizer` and `TorchOptimizer` override
`BaseOptimizer`. Hooks are methods of the optimizer, prefixed `_accum_` so
they never shadow a parent optimizer's own names.
"""

import contextlib

from keras import ops

from accum_optimizers import _inputs
from accum_optimizers._finite import all_finite
from accum_optimizers._finite import sums_of_squares
from accum_optimizers._window.spec import resetting_variables


class Accumulation:
    """Default accumulation hooks (eager branching, `ops` arithmetic)."""

    def _accum_colocate(self, reference):
        """Context in which a new optimizer variable is placed with
        `reference` (a model variable, or `None`)."""
        return contextlib.nullcontext()

    @staticmethod
    def _accum_outside_compiled_code():
        """Context in which assignments run once, now, even while a
        compiled function is being traced (restoring state in `build`).
        Static: a wrapper's own variables need it too
        (`_backend.outside_compiled_code`)."""
        return contextlib.nullcontext()

    def _accum_after(self, grads):
        """Context in which the call's counters change only once `grads`
        (one gradient or `None` per variable) exist: in a graph, a step
        that fails to produce its data must change no counter. The sums
        need none: each waits for its own gradient."""
        return contextlib.nullcontext()

    def _accum_begin_apply(self):
        """Called first in every `apply` of an accumulating optimizer,
        before its inputs are read (torch: the backward that ran since the
        last `apply` is this call's, see `torch_overlap.py`)."""

    def _accum_check_gradients(self, grads, weight, scaled):
        """Raises, before any state changes, where the backend cannot take
        `grads` (one gradient or `None` per variable) with `weight` (the
        call's, checked: `None`, a float or a traced scalar); `scaled`:
        the gradients arrive multiplied by `weight`."""

    def _accum_micro_step(
        self, sums, grads, new_window, update_switch, apply_window, weight=None
    ):
        """One micro-step: add `grads` into `sums`, and close the window.

        Args:
            sums: the accumulator variables, one per gradient.
            grads: this micro-batch's gradients; `None` adds nothing.
            new_window: scalar bool, this is the window's first micro-step:
                `sums` may hold the previous window's values (see
                `_accum_end_window`) and must be overwritten.
            update_switch: scalar bool, this is the window's last
                micro-step.
            apply_window: called as `apply_window(totals)`, with `totals`
                the window's sums including `grads`, only when
                `update_switch` is true.
            weight: `None`, or the number (a Python float or a scalar
                tensor) to multiply `grads` by before adding them.
        """
        self._accum_add(sums, grads, new_window, weight)
        self._accum_run_if(
            update_switch, lambda: apply_window([s.value for s in sums])
        )

    def _accum_add(self, sums, grads, new_window, weight=None):
        """`sum += weight * grad`, or `sum = weight * grad` (zero for
        `None`) on a new window.

        One select fused into the add: under XLA cheaper than zeroing the
        sums in a separate pass.
        """
        grads = self._accum_weighed(sums, grads, weight)
        for total, grad in zip(sums, grads):
            if grad is None:
                grad = ops.zeros(total.shape, total.dtype)
                added = total.value
            else:
                grad = ops.cast(grad, total.dtype)
                added = ops.add(total.value, grad)
            total.assign(ops.where(new_window, grad, added))

    def _accum_run_if(self, pred, fn):
        """Runs `fn()`, which assigns variables, only when `pred` is true,
        without computing its math otherwise."""
        if bool(pred):
            fn()

    def _accum_check_traced_weight(self, weight):
        """`(weight, context)`: makes the call fail, before the state
        changes run in `context`, unless the traced scalar `weight` is
        finite and `> 0` (concrete weights are checked in Python). Where
        compiled code cannot fail (XLA), the returned weight is NaN
        instead, which makes the window's update NaN."""
        return weight, contextlib.nullcontext()

    def _accum_zero_weight_allowed(self):
        """Whether a weight may be `0`: a replica's, under tf.distribute,
        whose share of the micro-batch is empty."""
        return False

    def _accum_weighed(self, sums, grads, weight):
        """`grads` multiplied by `weight` (unchanged for `None`), each in
        its sum's dtype."""
        if weight is None:
            return grads
        return [
            None if grad is None else self._accum_scale(grad, weight, s.dtype)
            for s, grad in zip(sums, grads)
        ]

    def _accum_scale(self, grad, weight, dtype):
        """`weight * grad`, in `dtype` (the sum's), multiplied in float32 at
        least: a token count is not a bfloat16 number."""
        wide = "float64" if dtype == "float64" else "float32"
        product = ops.multiply(ops.cast(grad, wide), ops.cast(weight, wide))
        return ops.cast(product, dtype)

    def _accum_reduce_window(self, sums, extras, total_weight):
        """`(sums, extras, total_weight)`: the window's gradient `sums` and
        its other float32 tensors (`extras`: its loss sum, seen-mask and
        noise sums) added over replicas, and its total weight averaged over
        them (each replica's gradients are already divided by the number
        of replicas, as Keras' losses do); a no-op where programs see
        global arrays (keras.distribution) or there is one replica."""
        return sums, extras, total_weight

    def _accum_window_mean(self, totals, count):
        """`totals / count`."""
        return [ops.divide(t, ops.cast(count, t.dtype)) for t in totals]

    def _accum_finite_everywhere(self, finite):
        """Whether every process's pending window is finite, given whether
        this one's is (`flush` discards a window unless all are)."""
        return finite

    def _accum_store_means(self, sums, means):
        """The window's means, to hand to the parent's update; a backend
        may keep them in `sums` (the accumulator variables), which the
        window leaves dead (see `_accum_end_window`)."""
        return means

    def _accum_if_finite(self, finite, micro_step):
        """Runs the micro-step unless `finite`, a traced scalar bool, is
        false. `micro_step(finite)` masks its state changes by `finite`
        (`micro_step(None)`: unmasked). The default masks: compiled code
        that copies every variable a branch writes (XLA) runs the same ops
        either way."""
        micro_step(finite)

    def _accum_agree_finite(self, finite):
        """Whether every replica's (or rank's) micro-batch gradients are
        finite, given whether this one's are (a scalar bool): a skipped
        micro-batch is skipped everywhere. Identity where programs see
        global arrays (keras.distribution) or there is one replica."""
        return finite

    def _accum_end_window(self):
        """Starts a new window: the variables the spec declares `resets`
        are zeroed; the sums are left for the next window's first
        micro-step to overwrite."""
        for counter in resetting_variables(self):
            counter.assign(ops.zeros(counter.shape, counter.dtype))

    def _accum_note_loss(self, loss):
        """Keeps the loss of this thread's micro-batch for its `apply`
        (`fit` computes the loss, then applies its gradients)."""
        if self._has_window:
            _inputs.put_loss(self, loss)

    def _accum_loss_outside_apply(self):
        """The micro-batch's loss where it reaches the optimizer neither as
        an argument nor through `_accum_note_loss`, or `None`."""
        return None

    def _accum_all_finite(self, grads, squares=None):
        """Whether every entry of `grads` is finite (`skip_nonfinite`): a
        bool, or a traced scalar bool. `squares`: the gradients' sums of
        squares where the noise scale is measured (see `all_finite`)."""
        return all_finite(grads, squares=squares)

    def _accum_sums_of_squares(self, grads):
        """The float32 sum of squares of each gradient (`None`s left out),
        for the noise scale."""
        return sums_of_squares(grads)

    def _accum_samples_in(self, total_weight):
        """What a closing window adds to `samples_seen`, from its total
        weight as the close divides by it."""
        return total_weight

    def _accum_replicas(self):
        """The number of replicas `R` whose gradients each arrive divided
        by `R` and are added over them once per window (tf.distribute, as
        Keras' losses divide them); 1 where programs see global arrays
        (keras.distribution) or each rank's gradients are its own mean
        (torch `sync_windows`)."""
        return 1
