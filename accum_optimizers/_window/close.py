"""The window's close: its sums reduced over replicas, their mean, the
window's metrics, the parent's update, the samples count; and `flush`, which
closes a partial window.

The close runs once per window, inside the backend's branch of the
micro-step that fills it (or eagerly, from `flush`): the update math, the
all-reduce of `tf.distribute` and `sync_windows`, clipping, weight decay and
EMA run there and nowhere else.
"""

import warnings

import numpy as np
from keras import ops


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
        if not self._accumulates or not self.built:
            return
        pending = int(ops.convert_to_numpy(self._accum_micro_steps.value))
        if pending == 0:
            return
        seen = ops.convert_to_numpy(self._accum_seen.value)
        chosen = [
            i
            for i, variable in enumerate(self._trainable_variables)
            if seen[i] and variable.trainable
        ]
        totals = {i: self._accum_sums[i].value for i in chosen}
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
        if not finite or not chosen:
            self._accum_end_window()
            return
        self._accum_apply_window(totals, chosen)

    def _accum_apply_window(self, totals, present):
        """Applies the window's mean gradient, then starts a new window.

        Args:
            totals: `{variable index: the window's sum}` for the summed
                variables (on torch the sums themselves, which the mean may
                overwrite in place).
            present: indices of the variables to update: those with a
                gradient in the call that closes the window (as Keras'
                own accumulation), or the ones `flush` chose. The window's
                sums of the others are dropped.

        Under `tf.distribute` the replicas' sums and weights are added
        here, once per window, so that clipping and the update see the
        global mean gradient, as on one device with the global batch.
        """
        variables = self._trainable_variables
        summed = [i for i in present if i in totals]
        sums, loss_sum, noise, total_weight = self._accum_reduced_window(
            [totals[i] for i in summed]
        )
        # A window whose micro-batches all weigh 0 (`fit`: every sample
        # weight or token masked) has zero sums: a zero gradient, as the
        # big batch's `divide_no_nan`.
        divisor = ops.where(ops.greater(total_weight, 0.0), total_weight, 1.0)
        grad_norm = _norm_of_mean(sums, divisor)
        self._accum_window_grad_norm.assign(grad_norm)
        self._accum_close_noise(noise, ops.square(grad_norm), total_weight)
        means = self._accum_window_mean(sums, divisor)
        means = self._accum_store_means(
            [self._accum_sums[i] for i in summed], means
        )
        self._accum_window_loss.assign(ops.divide(loss_sum, divisor))
        grads = dict(zip(summed, means))
        for i in present:
            if i not in totals:
                grads[i] = self._accum_sums[i].value  # a window's maximum
        super().apply(
            [ops.cast(grads[i], variables[i].dtype) for i in present],
            [variables[i] for i in present],
        )
        # After the update, whose learning rate is that of the samples
        # seen before the window.
        self._accum_count_samples(self._accum_samples_in(total_weight))
        self._accum_end_window()

    def _accum_reduced_window(self, sums):
        """`(sums, loss_sum, noise, total_weight)`: the window's `sums`, loss
        sum, noise-scale sums and total weight, added over replicas (once,
        in one exchange)."""
        # Read the counts here, inside the branch: under TensorFlow's XLA
        # loop, a tensor captured from outside costs every micro-step.
        total_weight = self._accum_total_weight.value
        noise = self._accum_noise_window_values()
        reduced, total_weight = self._accum_reduce_window(
            list(sums) + [self._accum_loss_sum.value] + noise, total_weight
        )
        noise = reduced[len(reduced) - len(noise) :]
        reduced = reduced[: len(reduced) - len(noise)]
        return reduced[:-1], reduced[-1], noise, total_weight

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
        # `fit` calls this once, at the end of training.
        if self._accumulates and self.built:
            self._accum_report_refused_weights()
        if self._accumulates and self.built and not self.flush_at_train_end:
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
