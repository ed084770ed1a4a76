"""A micro-step: the call's inputs checked, every new value computed, then
committed.

`apply(grads, weight=, loss=)` first takes what arrived beside its
arguments (`_inputs`), then checks the gradients, the weight and the loss,
decides whether the micro-batch enters its window (`skip_nonfinite`, a
weight compiled code could not refuse), and computes the window's new
counters, loss sum and seen-mask. Only then does it write: the counters,
the gradients into their sums, and on the window's last micro-step the
window's close (`close.py`). A call that raises before the writes changes
nothing, by construction: no value is assigned while any is still being
computed.
"""

import contextlib

import keras
import numpy as np
from keras import ops

from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers._finite import masked
from accum_optimizers._validation import concrete_value
from accum_optimizers._validation import validate_gradient
from accum_optimizers._validation import validate_loss
from accum_optimizers._validation import validate_weighable
from accum_optimizers._validation import validate_weight


class WindowStep:
    """`apply`, `apply_gradients` and `stateless_apply` of an accumulating
    optimizer (a mixin of `GradientAccumulation`)."""

    def apply(self, grads, trainable_variables=None, *, weight=None, loss=None):
        """Adds a micro-batch's gradients to the window; updates the
        weights on the window's last micro-batch.

        Args:
            grads: one gradient (or `None`) per variable.
            trainable_variables: the variables, in the order of `grads`.
                Defaults to the variables the optimizer was built with.
                A variable left out counts as a `None` gradient.
            weight: Optional number or scalar tensor, finite and `> 0`: the
                normalizer of the micro-batch's loss (its sample count, the
                sum of its sample weights, or its count of valid tokens).
                The window then applies sum(weight_j * grads_j) /
                sum(weight_j), the mean gradient of the window's
                concatenated batch. Defaults to `None`, which counts `1`.
                Under `tf.distribute`, pass each replica's own weight (`0`
                for a replica whose share of the micro-batch is empty): the
                weights are summed over replicas with the gradients, once
                per window.
            loss: Optional scalar: the micro-batch's loss (its mean, before
                any loss scaling), for `window_loss`, weighed like the
                gradients. `fit` passes it on its own. Defaults to `None`.
        """
        if self._has_window:
            self._accum_begin_apply()
        # What arrived beside the arguments is taken first: a call that
        # raises leaves nothing behind for the next one.
        micro_batch, checked = self._accum_inputs(
            _inputs.take(self), weight, loss
        )
        with checked:
            self._accum_apply(grads, trainable_variables, micro_batch)

    def _accum_inputs(self, pending, weight, loss):
        """`(micro_batch, context)`: the call's inputs besides its gradients
        (its arguments, else what `pending` holds), checked; and the context
        in which its state changes run (a graph's check of a traced
        weight)."""
        if loss is None:
            loss = pending.loss
        if loss is None and self._has_window:
            loss = self._accum_loss_outside_apply()
        loss = validate_loss(loss)
        handoff = pending.handoff
        scaled, check, valid = False, True, None
        checked = contextlib.nullcontext()
        if weight is None and handoff is not None:
            weight = handoff.weight
            scaled, check = handoff.loss_scaled, handoff.check
            if handoff.checked is not None:
                checked = handoff.checked()
            if handoff.may_be_invalid:
                valid = ops.isfinite(ops.cast(weight, "float32"))
        if weight is not None and self._has_window:
            validate_weighable(self.accumulator_dtype)
        if weight is not None:
            # Windows count samples from now on: a Python fact, known when
            # a compiled step is traced (see `_accum_samples_in`).
            self._accum_counts_weights = True
        if weight is not None and check:
            weight, checked = self._accum_checked_weight(weight)
        micro_batch = _MicroBatch(weight, scaled, loss, valid, pending.finite)
        return micro_batch, checked

    def apply_gradients(self, grads_and_vars, *, weight=None, loss=None):
        """`apply` on `(gradient, variable)` pairs; see `apply` for
        `weight` and `loss`. Returns `iterations`, the number of applied
        updates."""
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight, loss=loss)
        return self._iterations

    def stateless_apply(
        self,
        optimizer_variables,
        grads,
        trainable_variables,
        *,
        weight=None,
        loss=None,
    ):
        """Keras' `stateless_apply` (JAX and torch), with `apply`'s
        `weight` and `loss`."""
        if loss is not None:
            _inputs.put_loss(self, loss)
        if weight is not None:
            _inputs.hand_over(self, _inputs.Handoff(weight, check=True))
        try:
            return super().stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
        finally:
            _inputs.discard(self)  # left over only if it raised early

    def _accum_apply(self, grads, trainable_variables, micro_batch):
        """`apply` once its inputs are checked (`micro_batch`)."""
        if not self._has_window:
            # A window of one micro-batch: its weight cancels out.
            return super().apply(grads, trainable_variables)
        grads = list(grads)
        if not grads:
            return
        grads = self._accum_gradients_of_every_variable(
            grads, trainable_variables
        )
        self._accum_check_gradients(
            grads, micro_batch.weight, micro_batch.scaled
        )
        with keras.name_scope(self.name, caller=self):
            # One read of the gradients for the noise scale and the
            # finiteness check both.
            micro_batch.squares = self._accum_noise_squares(grads)
            enters = self._accum_enters_window(grads, micro_batch)
            if enters is None:
                return self._accum_take_micro_step(grads, micro_batch, None)
            known = concrete_value(enters)
            if known is None:
                # In compiled code: a branch where the backend's branches
                # may write variables, else the same ops masked by
                # `enters` (see `_backend`).
                return self._accum_if_finite(
                    enters,
                    lambda finite: self._accum_take_micro_step(
                        grads, micro_batch, finite
                    ),
                )
            if bool(known):
                return self._accum_take_micro_step(grads, micro_batch, None)
            self._accum_skipped.assign(self._accum_skipped + 1)

    def _accum_enters_window(self, grads, micro_batch):
        """Whether the micro-batch enters its window (a bool, or a traced
        scalar bool), or `None` where every micro-batch does: with
        `skip_nonfinite`, whether its gradients are finite on every
        replica; and whether its weight is valid (see `_MicroBatch`)."""
        enters = None
        if self.skip_nonfinite:
            enters = micro_batch.finite
            if enters is None:
                enters = self._accum_all_finite(grads, micro_batch.squares)
        if micro_batch.valid is not None:
            enters = (
                micro_batch.valid
                if enters is None
                else ops.logical_and(enters, micro_batch.valid)
            )
        if enters is None:
            return None
        return self._accum_agree_finite(enters)

    def _accum_take_micro_step(self, grads, micro_batch, finite):
        """The micro-step's state changes: every new value computed, then
        written. With `finite` (a traced scalar bool) they change nothing
        but the skip count where it is false."""
        overwrite = [
            self._overwrite_variable_with_gradient(v)
            for v in self._trainable_variables
        ]
        summed = [i for i, over in enumerate(overwrite) if not over]
        present = [i for i, grad in enumerate(grads) if grad is not None]
        if finite is not None:
            grads = [masked(g, finite) for g in grads]
        counts, new_window, update_switch = self._accum_next_counts(
            grads, micro_batch, finite
        )
        # Only the counters wait for the gradients: the predicates above
        # must not, or each gradient would be held until the last one
        # exists.
        with self._accum_after(grads):
            for name, value in counts.items():
                getattr(self, f"_accum_{name}").assign(value)
        # Masked like the gradients: a weight compiled code refused is NaN,
        # and 0 * NaN would poison the window's sums.
        weight = micro_batch.weight
        weight = None if micro_batch.scaled else masked(weight, finite)
        try:
            for i in np.flatnonzero(overwrite):
                self._accum_keep_maximum(self._accum_sums[i], grads[i], finite)
            # accumulate, or add and apply on the window's last micro-step.
            self._accum_micro_step(
                [self._accum_sums[i] for i in summed],
                [grads[i] for i in summed],
                new_window,
                update_switch,
                lambda totals: self._accum_apply_window(
                    dict(zip(summed, totals)), present
                ),
                weight,
            )
        except Exception as error:
            if self._accum_writes_directly():
                error.add_note(_PARTLY_WRITTEN)
            raise

    def _accum_writes_directly(self):
        """Whether this micro-step's writes land in the variables as it
        runs, so that an error after its commit began leaves them partly
        written: run eagerly, outside a `StatelessScope` (an error while a
        graph is traced, or inside a stateless step whose state is taken
        only when it completes, wrote nothing)."""
        return (
            concrete_value(self._accum_micro_steps.value) is not None
            and not _keras_private.in_stateless_scope()
        )

    def _accum_next_counts(self, grads, micro_batch, finite):
        """`(counts, new_window, update_switch)`: the window's counters,
        loss sum and seen-mask after this micro-step (`{name: value}`, not
        yet written), whether it opens a window, and whether it closes
        one."""
        weight = micro_batch.weight
        weight = 1.0 if weight is None else ops.cast(weight, "float32")
        step = 1 if finite is None else ops.cast(finite, "int32")
        micro_steps = self._accum_micro_steps + step
        new_window = ops.equal(micro_steps, 1)
        update_switch = ops.greater_equal(
            micro_steps, self._accum_window_size()
        )
        if finite is not None:
            new_window = ops.logical_and(new_window, finite)
            update_switch = ops.logical_and(update_switch, finite)
        loss = micro_batch.loss
        # A micro-batch without its loss makes its window report none.
        loss = float("nan") if loss is None else ops.cast(loss, "float32")
        seen = ops.convert_to_tensor(
            np.asarray([g is not None for g in grads], "int32")
        )
        if finite is not None:
            seen = ops.multiply(seen, ops.cast(finite, "int32"))
        counts = {
            "total_weight": ops.add(
                self._accum_total_weight.value, masked(weight, finite)
            ),
            "loss_sum": ops.add(
                self._accum_loss_sum.value,
                masked(ops.multiply(loss, weight), finite),
            ),
            "micro_steps": micro_steps,
            "micro_batches": self._accum_micro_batches + step,
            "seen": ops.where(
                new_window, seen, ops.maximum(self._accum_seen.value, seen)
            ),
        }
        counts.update(self._accum_noise_counts(micro_batch, finite))
        if finite is not None:
            counts["skipped"] = self._accum_skipped + 1 - step
        return counts, new_window, update_switch

    def _accum_keep_maximum(self, total, grad, finite=None):
        """float8 scale variables (`overwrite_with_gradient`): the window
        keeps the maximum of its "gradients", as the big batch computes
        (unchanged by a skipped micro-batch: `finite` false)."""
        if grad is None:
            return
        grad = ops.cast(grad, total.dtype)
        new_window = ops.equal(self._accum_micro_steps.value, 1)
        kept = ops.where(new_window, grad, ops.maximum(total.value, grad))
        if finite is not None:
            kept = ops.where(finite, kept, total.value)
        total.assign(kept)

    def _accum_checked_weight(self, weight):
        """`(weight, context)`: `weight` as a Python float (concrete) or a
        float32 tensor (traced), refused unless a finite scalar > 0, and the
        context in which the call's state changes run.

        A concrete value is checked now; a traced one at run time by the
        backend (`_accum_check_traced_weight`), before the state changes
        that run in the context.
        """
        value = concrete_value(weight)
        if value is not None:
            zero_allowed = self._accum_zero_weight_allowed()
            weight = validate_weight(value, weight, zero_allowed)
            return weight, contextlib.nullcontext()
        weight = ops.convert_to_tensor(weight)
        if len(weight.shape) != 0:
            raise ValueError(
                "`weight` must be a scalar. Received: weight with shape "
                f"{tuple(weight.shape)}"
            )
        return self._accum_check_traced_weight(ops.cast(weight, "float32"))

    def _accum_gradients_of_every_variable(self, grads, trainable_variables):
        """`grads` checked and laid out over every built variable.

        Everything that can make the call fail is checked here, before any
        state changes. A variable not passed gets `None`.
        """
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer "
                    "must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            variables = self._trainable_variables
        else:
            variables = list(trainable_variables)
        if len(grads) != len(variables):
            raise ValueError(
                f"Received {len(grads)} gradients for {len(variables)} "
                "variables; pass one gradient (or `None`) per variable."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        self._check_variables_are_known(variables)
        laid_out = [None] * len(self._trainable_variables)
        for grad, variable in zip(grads, variables):
            if grad is not None:
                validate_gradient(grad, variable)
                laid_out[self._get_variable_index(variable)] = grad
        if all(grad is None for grad in laid_out):
            raise ValueError("No gradients provided for any variable.")
        return laid_out


_PARTLY_WRITTEN = (
    "accum_optimizers: this error was raised after the micro-step had begun "
    "to write the optimizer's state (the window's counters and sums, and "
    "maybe part of the parent's update): the optimizer and the model are "
    "partly updated and cannot continue exactly. Restore them from a "
    "checkpoint."
)


class _MicroBatch:
    """A micro-step's checked inputs besides its gradients.

    Args:
        weight: `None` (counts 1), a Python float, or a float32 scalar.
        scaled: whether the gradients arrive multiplied by `weight` (see
            `scale_loss`).
        loss: the micro-batch's loss (a float32 scalar), or `None`.
        valid: `None`, or whether a weight that compiled code could not
            refuse is valid (it is NaN where not): a micro-batch whose
            weight is not is left out of its window, as a skipped one.
        finite: `None`, or whether a wrapper found every gradient finite
            (`MultiOptimizer`).

    Attributes:
        squares: the gradients' sums of squares (`measure_noise_scale`),
            set once the gradients are laid out, else `None`.
    """

    def __init__(self, weight, scaled, loss, valid, finite):
        self.weight = weight
        self.scaled = scaled
        self.loss = loss
        self.valid = valid
        self.finite = finite
        self.squares = None
