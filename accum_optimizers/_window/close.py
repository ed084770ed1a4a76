"""The window's close: its sums reduced over replicas, their mean, the
window's metrics, the parent's update, the samples count; and `flush`, which
closes a partial window.

The close runs once per window, inside the backend's branch of the
micro-step that fills it (or eagerly, from `flush`): the update math, the
all-reduce of `tf.distribute` and `sync_windows`, clipping, weight decay and
EMA run there and nowhere else.
"""

import contextlib
import warnings

import numpy as np
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers._validation import concrete_value


class WindowClose:
    """The window's close and `flush` (a mixin of `GradientAccumulation`)."""

    def flush(self):
        """Applies the pending partial window, if any, and starts a new one.

        The update uses the (weighted, see `apply`) mean of the gradients
        of the micro-batches the window holds (`micro_steps` of them), so a
        flushed window of `m` micro-batches of size `b` equals the parent
        optimizer on one batch of `m * b`. Only variables that are
        trainable now and received gradient in the window are updated. A
        window whose gradients are not all finite (after a `TerminateOnNaN`
        stop, say) is discarded with a warning, leaving the weights as they
        are. Does nothing when no micro-batch is pending or with
        `accum_iters=1`. Call it eagerly (the `FlushAccumulation` callback
        does, at the end of epochs or of training).
        """
        if not self._has_window or not self.built:
            return
        pending = int(ops.convert_to_numpy(self._accum_micro_steps.value))
        if pending == 0:
            return
        totals = {i: total.value for i, total in self._accum_summed()}
        finite = self._accum_finite_everywhere(
            all(
                np.isfinite(ops.convert_to_numpy(t)).all()
                for t in totals.values()
            )
        )
        if not finite:
            warnings.warn(
                f"{type(self).__name__}.flush(): the pending window of "
                f"{pending} micro-batches holds non-finite gradients; it was "
                "discarded and the weights were left unchanged.",
                stacklevel=2,
            )
            self._accum_end_window()
            return
        self._accum_apply_window(totals)

    def _accum_summed(self):
        """`(index, sum)` of every variable whose window adds its gradients
        (all but float8 scales, which keep a maximum)."""
        return [
            (i, total)
            for i, (total, variable) in enumerate(
                zip(self._accum_sums, self._trainable_variables)
            )
            if not self._overwrite_variable_with_gradient(variable)
        ]

    def _accum_apply_window(self, totals, present=()):
        """Applies the window's mean gradient, then starts a new window.

        Every variable that had gradient in any micro-step of the window,
        on any replica or rank, is updated with the window's mean (the
        micro-steps without its gradient count zero), as the big batch
        updates it; a variable with none in the whole window is left
        alone, as the parent leaves it, and so is one not trainable now.

        Args:
            totals: `{variable index: the window's sum}` for every summed
                variable (on torch the sums themselves, which the mean may
                overwrite in place). Every replica passes the same indices:
                they are exchanged whether or not they had gradient.
            present: indices of the variables with a gradient in the call
                that closes the window: known to be updated while compiled
                code is traced, where the seen-mask is not known yet.

        Under `tf.distribute` and torch `sync_windows` the replicas' sums,
        seen-masks and weights are added here, once per window, so that
        clipping and the update see the global mean gradient, as on one
        device with the global batch.
        """
        variables = self._trainable_variables
        summed = sorted(totals)
        sums, loss_sum, noise, seen, total_weight = self._accum_reduced_window(
            [totals[i] for i in summed]
        )
        updated, masks = self._accum_updated(seen, summed, present)
        # The big batch of a model whose layer was frozen mid-window does
        # not reach it either.
        updated = [i for i in updated if variables[i].trainable]
        if not updated:
            # A window of frozen variables only (a flush after freezing
            # them): no update, as the parent makes none without gradients.
            self._accum_end_window()
            return
        reduced = dict(zip(summed, sums))
        averaged = [i for i in updated if i in reduced]
        sums = [reduced[i] for i in averaged]
        # A window whose micro-batches all weigh 0 (`fit`: every sample
        # weight or token masked) has zero sums: a zero gradient, as the
        # big batch's `divide_no_nan`.
        divisor = ops.where(ops.greater(total_weight, 0.0), total_weight, 1.0)
        grad_norm = _norm_of_mean(sums, divisor)
        self._accum_window_grad_norm.assign(grad_norm)
        self._accum_close_noise(noise, ops.square(grad_norm), total_weight)
        means = self._accum_window_mean(sums, divisor)
        means = self._accum_store_means(
            [self._accum_sums[i] for i in averaged], means
        )
        self._accum_window_loss.assign(ops.divide(loss_sum, divisor))
        grads = dict(zip(averaged, means))
        for i in updated:
            if i not in grads:
                grads[i] = self._accum_sums[i].value  # a window's maximum
        with _masked_updates(self, masks):
            super().apply(
                [ops.cast(grads[i], variables[i].dtype) for i in updated],
                [variables[i] for i in updated],
            )
        # After the update, whose learning rate is that of the samples
        # seen before the window.
        self._accum_count_samples(self._accum_samples_in(total_weight))
        self._accum_end_window()

    def _accum_updated(self, seen, summed, present):
        """`(updated, masks)`: the indices of the variables the window
        updates, and `{index: traced bool}` for those of them that compiled
        code updates only where the bool is true.

        Where the closing call has every gradient, all of them. Where
        `seen` (the window's seen-mask, added over replicas) is known, the
        variables it marks. While compiled code is traced it is not:
        the closing call's variables (`present`) are updated, and every
        other summed one is updated under its seen bit.
        """
        if set(summed) <= set(present):
            # Every variable has gradient in the closing call: no read of
            # the mask (a device sync, eagerly), no branch.
            return list(present), {}
        known = concrete_value(seen)
        if known is not None:
            return [i for i in range(len(known)) if known[i] > 0], {}
        maybe = [i for i in summed if i not in present]
        masks = {i: ops.greater(seen[i], 0) for i in maybe}
        return sorted(set(present) | set(maybe)), masks

    def update_step(self, gradient, variable, learning_rate):
        mask = _update_mask(self, variable)
        parent_update_step = super().update_step
        if mask is None:
            return parent_update_step(gradient, variable, learning_rate)

        def update():
            # Its weight decay too, which `_apply_weight_decay` left out:
            # Keras' own would `merge_call` inside this branch under
            # tf.distribute.
            _keras_private.decay_weight(self, variable)
            parent_update_step(gradient, variable, learning_rate)

        self._accum_run_if(mask, update)

    def _apply_weight_decay(self, variables):
        if _masks_of(self):
            # Variables updated under a mask decay in their `update_step`.
            variables = [v for v in variables if _update_mask(self, v) is None]
        super()._apply_weight_decay(variables)

    def _accum_reduced_window(self, sums):
        """`(sums, loss_sum, noise, seen, total_weight)`: the window's
        `sums`, loss sum, noise-scale sums, seen-mask (float32) and total
        weight, added over replicas (once, in one exchange)."""
        # Read the counts here, inside the branch: under TensorFlow's XLA
        # loop, a tensor captured from outside costs every micro-step.
        total_weight = self._accum_total_weight.value
        extras = [
            self._accum_loss_sum.value,
            ops.cast(self._accum_seen.value, "float32"),
            *self._accum_noise_window_values(),
        ]
        sums, extras, total_weight = self._accum_reduce_window(
            list(sums), extras, total_weight
        )
        return sums, extras[0], extras[2:], extras[1], total_weight

    def _accum_count_samples(self, weight):
        """`samples_seen += weight`, compensated (Knuth's two-sum): the
        pair's sum stays exact where a float32 total would drop tokens
        once it passes 2**24."""
        total = self._accum_samples_seen.value
        added = ops.add(total, weight)
        kept = ops.subtract(added, total)
        lost = ops.add(
            ops.subtract(total, ops.subtract(added, kept)),
            ops.subtract(weight, kept),
        )
        self._accum_samples_seen.assign(added)
        self._accum_samples_seen_error.assign(
            ops.add(self._accum_samples_seen_error.value, lost)
        )

    def finalize_variable_values(self, var_list):
        # `fit` calls this once, at the end of training. The flag is this
        # `fit`'s alone, also where the report below raises.
        flushed, self.flush_at_train_end = self.flush_at_train_end, False
        if self._has_window and self.built:
            self._accum_report_refused_weights()
        if self._has_window and self.built and not flushed:
            try:
                pending = ops.convert_to_numpy(self._accum_micro_steps.value)
            except TypeError:
                # A JAX train step that failed leaves the variables without
                # values; let its own error through.
                pending = 0
            if int(pending):
                warnings.warn(
                    f"Training ended with {pending} micro-batches of a window "
                    f"pending in {type(self).__name__}: they carry into the "
                    "next `fit`, and the weights do not include them yet. To "
                    "apply them as a last, smaller update (as the big-batch "
                    "run's short last batch), add "
                    "`accum_optimizers.FlushAccumulation()` to the callbacks, "
                    "or use a sample count that is a multiple of "
                    "`batch_size * accum_iters`.",
                    stacklevel=2,
                )
        super().finalize_variable_values(var_list)

    def _accum_report_refused_weights(self):
        """Raises, at the end of `fit`, for micro-batches that compiled code
        left out of their windows because `weigh_micro_batches` found their
        loss normalizer negative or not finite (it cannot raise there): with
        `skip_nonfinite=False` nothing else leaves a micro-batch out."""
        if self.skip_nonfinite:
            return
        try:
            skipped = int(ops.convert_to_numpy(self._accum_skipped.value))
        except TypeError:
            return  # A failed JAX step; its own error goes through.
        reported = self.__dict__.get("_accum_refused_reported", 0)
        if skipped > reported:
            self._accum_refused_reported = skipped
            raise ValueError(
                f"weigh_micro_batches(model): {skipped - reported} "
                "micro-batches had a loss normalizer (the sum of their "
                "sample weights) that is negative or not finite; they were "
                "left out of their windows, and the weights did not move for "
                "them. Negative sample weights are not supported. Received: "
                f"skipped_micro_batches={skipped}"
            )


def _norm_of_mean(sums, divisor):
    """The norm of the window's mean, `sums / divisor`, from the sums,
    before the means replace them: read after (or from scaled sums), XLA
    keeps every mean beside the sums. Infinite where the squares of the
    sums overflow float32 (weighted sums above about 1e19)."""
    return ops.divide(_global_norm(sums), divisor)


def _global_norm(tensors):
    """The float32 norm of `tensors` taken together."""
    squares = [
        ops.sum(ops.square(ops.cast(tensor, "float32"))) for tensor in tensors
    ]
    if not squares:
        return ops.zeros((), "float32")
    return ops.sqrt(ops.sum(ops.stack(squares)))


@contextlib.contextmanager
def _masked_updates(optimizer, masks):
    """Within it, the parent's update of each variable whose index is in
    `masks` runs only where its traced bool is true."""
    optimizer._accum_update_masks = masks
    try:
        yield
    finally:
        optimizer._accum_update_masks = {}


def _masks_of(optimizer):
    return optimizer.__dict__.get("_accum_update_masks")


def _update_mask(optimizer, variable):
    """The traced bool under which `variable` is updated, or `None`."""
    masks = _masks_of(optimizer)
    if not masks:
        return None
    return masks.get(optimizer._get_variable_index(variable))
