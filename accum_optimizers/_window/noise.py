"""The gradient noise scale, measured by the window
(`measure_noise_scale=True`).

McCandlish et al., "An Empirical Model of Large-Batch Training" (2018),
Appendix A: with `G` the true gradient and `Sigma` the per-sample
covariance of the gradients, a mean gradient `g` over a batch of weight `n`
has `E|g|^2 = |G|^2 + tr(Sigma) / n`. A window holds gradients at two batch
sizes at the same weights: each micro-batch's mean gradient `g_j` (weight
`n_j`) and the window's mean `g` (weight `N = sum n_j`). The plain mean of
the `|g_j|^2` over the window's `m` micro-batches has expectation
`|G|^2 + tr(Sigma) / B_small`, `B_small = m / sum(1 / n_j)` (their harmonic
mean), and `|g|^2` has `|G|^2 + tr(Sigma) / N`. Solving the two gives the
paper's unbiased estimates, with `B_big = N`:

    |G|^2    ~ (N |g|^2 - B_small mean|g_j|^2) / (N - B_small)
    tr(Sigma) ~ (mean|g_j|^2 - |g|^2) / (1 / B_small - 1 / N)

(`N > B_small` for `m >= 2`; a window of one micro-batch gives none). The
two are averaged over windows (an exponential moving average, divided by
its total weight) and their ratio, the ratio of averages as in the paper,
is the noise scale `B_simple = tr(Sigma) / |G|^2`, in the unit of the
window's weight: samples (or tokens) when windows are weighted
(`weigh_micro_batches`, `apply(..., weight=n)`), micro-batches otherwise.

A micro-batch of weight 0 (a replica's empty share of the micro-batch, a
micro-batch whose sample weights are all 0) holds no sample: it adds
nothing to the sums (a `1 / 0` would make the window's estimates NaN).

Under `tf.distribute` with `R > 1` replicas, each replica's `apply`
receives the gradient of its own share of the micro-batch, not yet
all-reduced (Keras' optimizers all-reduce in `apply`; ours adds the
window's sums over replicas once, at the close: `_accum_reduce_window`),
divided by `R` (Keras' losses divide each replica's loss by the replica
count), with the share's own weight `n_rj`. The window's mean is then
`sum n_rj g_rj / N` over replicas and micro-steps, `g_rj` the share's mean
gradient and `N = sum n_rj`: each share is a micro-batch of the window,
one more draw at its own weight, and the two expectations above hold with
the window's shares (those of weight > 0) in place of its micro-batches.
So each replica adds `R^2 |x_rj|^2` (`x_rj = g_rj / R`, what it holds),
`1 / n_rj` and `1` to its own sums, which the close all-reduces with the
gradients' sums; `B_small` is the harmonic mean of the shares' weights
and `B_big = N = R T`, `T` the total weight the close sees (summed over
replicas and divided by `R`, as the gradients are). The replicas' own
norms are the samples at `B_small`: the global micro-batch's norm would
need the gradients all-reduced on every micro-step, the exchange the
window saves. Unweighted, a share counts 1: the unit is a replica's share
of the micro-batch, the micro-batch its `apply` receives (as a rank's
under torch's `sync_windows`); weighted, samples. A window of one
micro-step then gives estimates too, from its `R` shares.

Each micro-step adds one sum of squares per gradient, the pass that
`skip_nonfinite`'s check reads too (a sum of squares is non-finite where an
entry is, or where the squares overflow), and three scalars; the close
turns them into the estimates. No parameter-sized buffer, and no exchange
beyond the window's own.
"""

import numpy as np
from keras import ops

from accum_optimizers import schedules
from accum_optimizers._finite import masked

# The moving averages, in `WINDOW_STATE`.
_AVERAGES = (
    "gradient_sq_norm_average",
    "noise_trace_average",
    "noise_average_weight",
)


class WindowNoise:
    """The noise scale's micro-step, close and read-outs (a mixin of
    `GradientAccumulation`). Every read-out is NaN where the optimizer does
    not measure it."""

    def _accum_noise_squares(self, grads):
        """The float32 sum of squares of each gradient (`None`s left out),
        or `None` where the optimizer does not measure the noise scale."""
        if not self.measure_noise_scale:
            return None
        return self._accum_sums_of_squares(grads)

    def _accum_noise_counts(self, micro_batch, finite):
        """`{name: value}`: the window's noise sums after this micro-step
        (not yet written); empty where it is not measured."""
        squares = micro_batch.squares
        if squares is None:
            return {}
        sq_norm = (
            ops.sum(ops.stack(squares)) if squares else ops.zeros((), "float32")
        )
        replicas = self._accum_replicas()
        if replicas > 1:
            # A replica's gradient arrives divided by the replica count (as
            # Keras' losses scale it): its share's own mean is R times it.
            sq_norm = ops.multiply(sq_norm, float(replicas * replicas))
        enters = finite
        weight = micro_batch.weight
        if weight is None:
            weight = 1.0
        else:
            weight = ops.cast(weight, "float32")
            # A micro-batch (a replica's share) of weight 0 is no sample.
            drawn = ops.greater(weight, 0.0)
            weight = ops.where(drawn, weight, 1.0)
            enters = drawn if finite is None else ops.logical_and(drawn, finite)
        if micro_batch.scaled:
            # `fit`'s gradients arrive multiplied by the weight (see
            # `scale_loss`): the micro-batch's own mean is theirs over it.
            sq_norm = ops.divide(sq_norm, ops.square(weight))
        added = {
            "noise_sq_norm_sum": sq_norm,
            "noise_inverse_weight_sum": ops.divide(1.0, weight),
            "noise_micro_batches": ops.ones((), "float32"),
        }
        return {
            name: ops.add(
                getattr(self, f"_accum_{name}").value, masked(value, enters)
            )
            for name, value in added.items()
        }

    def _accum_noise_window_values(self):
        """The window's noise sums, to reduce over ranks with its gradient
        sums (`[]` where not measured)."""
        if not self.measure_noise_scale:
            return []
        return [
            self._accum_noise_sq_norm_sum.value,
            self._accum_noise_inverse_weight_sum.value,
            self._accum_noise_micro_batches.value,
        ]

    def _accum_close_noise(self, sums, big_sq_norm, total_weight):
        """The window's two estimates and their averages, from its reduced
        noise `sums` (`_accum_noise_window_values`), the squared norm of its
        mean gradient and its total weight (as the close computes it: over
        replicas, divided by their count)."""
        if not sums:
            return
        batch_big = ops.cast(total_weight, "float32")
        replicas = self._accum_replicas()
        if replicas > 1:
            # The replicas' shares' total weight: `B_big`.
            batch_big = ops.multiply(batch_big, float(replicas))
        gradient_sq_norm, trace, valid = _window_estimates(
            *sums, big_sq_norm, batch_big
        )
        nan = ops.convert_to_tensor(float("nan"), "float32")
        self._accum_window_gradient_sq_norm.assign(
            ops.where(valid, gradient_sq_norm, nan)
        )
        self._accum_window_noise_trace.assign(ops.where(valid, trace, nan))
        momentum = self.noise_scale_momentum
        averages = []
        for name, value in zip(_AVERAGES, (gradient_sq_norm, trace, 1.0)):
            variable = getattr(self, f"_accum_{name}")
            moved = ops.add(
                ops.multiply(momentum, variable.value),
                ops.multiply(1.0 - momentum, value),
            )
            averages.append(ops.where(valid, moved, variable.value))
        for name, value in zip(_AVERAGES, averages):
            getattr(self, f"_accum_{name}").assign(value)
        noise_scale = _ratio(averages[1], averages[0], averages[2])
        largest = self._accum_largest_noise_scale.value
        counted = ops.logical_and(valid, self._accum_noise_ready(averages[2]))
        self._accum_largest_noise_scale.assign(
            ops.where(counted, ops.maximum(largest, noise_scale), largest)
        )

    def _accum_noise_ready(self, weight):
        """Whether averages of total `weight` hold the `warmup_windows` of
        a `by_noise_scale` schedule (any estimate without one): the first
        estimates are too noisy to grow a window on."""
        schedule = self._accum_schedule
        warmup = 0
        if schedules.keyed_on_noise_scale(schedule):
            warmup = schedule.warmup_windows
        return ops.greater_equal(
            weight, _warm_weight(self.noise_scale_momentum, warmup)
        )

    def _accum_noise_key(self, schedule):
        """What a `by_noise_scale` schedule is keyed on: the largest noise
        scale measured since its warm-up (`grow_only`) or the current one
        (NaN before its warm-up ends)."""
        if not self.built or not self._has_window:
            return ops.convert_to_tensor(float("nan"), "float32")
        if schedule.grow_only:
            return self._accum_largest_noise_scale.value
        ready = self._accum_noise_ready(self._accum_noise_average_weight.value)
        return ops.where(
            ready, self._accum_noise_read("noise_scale"), float("nan")
        )

    def _accum_noise_read(self, what):
        """One read-out as a float32 scalar (NaN where not measured)."""
        if (
            not self.built
            or not self._has_window
            or not self.measure_noise_scale
        ):
            return ops.convert_to_tensor(float("nan"), "float32")
        if what.startswith("window_"):
            return ops.convert_to_tensor(getattr(self, f"_accum_{what}"))
        sq_norm, trace, weight = (
            getattr(self, f"_accum_{name}").value for name in _AVERAGES
        )
        if what == "noise_scale":
            return _ratio(trace, sq_norm, weight)
        value = sq_norm if what == "gradient_sq_norm" else trace
        nan = ops.convert_to_tensor(float("nan"), "float32")
        return ops.where(weight > 0, ops.divide(value, weight), nan)

    @property
    def noise_scale(self):
        """The gradient noise scale `B_simple = tr(Sigma) / |G|^2`
        (`measure_noise_scale=True`): the ratio of the moving averages of
        the windows' unbiased estimates, in the unit of the window's weight
        (samples when windows are weighted, micro-batches otherwise). The
        batch about which a bigger one stops paying in fewer updates.
        Infinite where the average `|G|^2` is not positive (the gradient
        is lost in its noise); NaN before the first window of two or more
        micro-batches, and where not measured."""
        return self._accum_noise_read("noise_scale")

    @property
    def gradient_sq_norm(self):
        """The moving average of the windows' unbiased estimates of
        `|G|^2`, the true gradient's squared norm (NaN before the first
        estimate, and where not measured)."""
        return self._accum_noise_read("gradient_sq_norm")

    @property
    def gradient_noise_trace(self):
        """The moving average of the windows' unbiased estimates of
        `tr(Sigma)`, the trace of the per-sample (per unit of weight)
        gradient covariance (NaN before the first estimate, and where not
        measured)."""
        return self._accum_noise_read("gradient_noise_trace")

    @property
    def window_gradient_sq_norm(self):
        """The last applied window's unbiased estimate of `|G|^2`: NaN for
        a window of one micro-batch, `0` before the first update."""
        return self._accum_noise_read("window_gradient_sq_norm")

    @property
    def window_noise_trace(self):
        """The last applied window's unbiased estimate of `tr(Sigma)`: NaN
        for a window of one micro-batch, `0` before the first update."""
        return self._accum_noise_read("window_noise_trace")


def _ratio(trace, sq_norm, weight):
    """`trace / sq_norm` of two averages of total `weight`: NaN without
    an estimate, infinite where the average `|G|^2` is not positive."""
    ratio = ops.where(
        sq_norm > 0,
        ops.divide(trace, ops.where(sq_norm > 0, sq_norm, 1.0)),
        float("inf"),
    )
    return ops.where(weight > 0, ratio, float("nan"))


def _warm_weight(momentum, windows):
    """The total weight of averages over `windows` estimates, less
    float32's round-off (0 for none)."""
    if windows <= 0:
        return 0.0
    return (1.0 - momentum**windows) * (1.0 - 1e-5)


def saved_noise_key(values, schedule, momentum):
    """The key of `schedule` (a `by_noise_scale`) a saved state holds
    (`values`: the window variables' saved values by name; see
    `restore.lasting_values`), with the averages' `momentum`."""
    if "largest_noise_scale" not in values:
        return np.float32(np.nan)
    if schedule.grow_only:
        return np.float32(values["largest_noise_scale"])
    sq_norm, trace, weight = (float(values[name]) for name in _AVERAGES)
    warm = _warm_weight(momentum, schedule.warmup_windows)
    if weight <= 0 or weight < warm:
        return np.float32(np.nan)
    return np.float32(trace / sq_norm if sq_norm > 0 else np.inf)


def measuring(optimizers):
    """The optimizers of `optimizers` that measure the noise scale."""
    return [o for o in optimizers if o.measure_noise_scale]


def read_outs_of(optimizers):
    """`{noise_scale, gradient_sq_norm, gradient_noise_trace}` as floats
    over `optimizers` (those that measure): one optimizer's own, or the
    components summed (a `MultiOptimizer`'s inner ones each see their own
    variables' gradients) and their ratio."""
    sq_norm = sum(
        float(ops.convert_to_numpy(o.gradient_sq_norm)) for o in optimizers
    )
    trace = sum(
        float(ops.convert_to_numpy(o.gradient_noise_trace)) for o in optimizers
    )
    if len(optimizers) == 1:
        noise_scale = float(ops.convert_to_numpy(optimizers[0].noise_scale))
    elif np.isnan(sq_norm) or np.isnan(trace):
        noise_scale = float("nan")
    else:
        noise_scale = trace / sq_norm if sq_norm > 0 else float("inf")
    return {
        "noise_scale": noise_scale,
        "gradient_sq_norm": sq_norm,
        "gradient_noise_trace": trace,
    }


def _window_estimates(
    sq_norm_sum, inverse_weight_sum, count, big_sq_norm, total_weight
):
    """`(|G|^2, tr(Sigma), valid)`: the paper's two unbiased estimates from
    a window's micro-batch gradients and their mean.

    Args:
        sq_norm_sum: the sum of its micro-batches' squared gradient norms.
        inverse_weight_sum: the sum of `1 / n_j`, their weights'.
        count: how many micro-batches it holds (`m`; under tf.distribute,
            the replicas' shares).
        big_sq_norm: the squared norm of its mean gradient.
        total_weight: its total weight, `B_big`.

    `B_small = m / sum(1 / n_j)`; `valid` is false for a window of one
    micro-batch, or whose estimates are not finite.
    """
    small_sq_norm = ops.divide(sq_norm_sum, ops.maximum(count, 1.0))
    batch_small = ops.divide(
        count, ops.where(inverse_weight_sum > 0, inverse_weight_sum, 1.0)
    )
    batch_big = ops.cast(total_weight, "float32")
    gap = ops.subtract(batch_big, batch_small)
    spread = ops.where(gap > 0, gap, 1.0)
    gradient_sq_norm = ops.divide(
        ops.subtract(
            ops.multiply(batch_big, big_sq_norm),
            ops.multiply(batch_small, small_sq_norm),
        ),
        spread,
    )
    trace = ops.divide(
        ops.multiply(
            ops.subtract(small_sq_norm, big_sq_norm),
            ops.multiply(batch_small, batch_big),
        ),
        spread,
    )
    valid = ops.logical_and(
        ops.logical_and(count >= 2.0, gap > 0),
        ops.logical_and(ops.isfinite(gradient_sq_norm), ops.isfinite(trace)),
    )
    return gradient_sq_norm, trace, valid
