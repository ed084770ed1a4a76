"""The gradient noise scale, measured by the window
(`measure_noise_scale=True`).

Each micro-step adds its gradients' squared norm, `1 / weight` and `1` to
the window's noise sums (`transition.py`); the close turns them and the
window's mean gradient into the unbiased estimates of `|G|^2` and
`tr(Sigma)` of McCandlish et al. (2018), Appendix A, and their moving
averages. `docs/noise-scale.md` derives the estimates, for weighted
micro-batches and for the replicas of `tf.distribute`.
"""

import math
import operator

import numpy as np
from keras import ops

from accum_optimizers import _backend
from accum_optimizers import schedules
from accum_optimizers._validation import concrete_value


def window_sums(window):
    """The window's noise sums, to reduce over replicas with its gradient
    sums (`[]` where not measured)."""
    if not window.measures_noise:
        return []
    return [
        window.noise_sq_norm_sum.value,
        window.noise_inverse_weight_sum.value,
        window.noise_micro_batches.value,
    ]


def close(optimizer, sums, big_sq_norm, total_weight):
    """Writes the window's two estimates and their averages, from its
    reduced noise `sums` (`window_sums`), the squared norm of its mean
    gradient and its total weight (over replicas, divided by their
    count)."""
    window = optimizer._window
    inputs = [
        *sums,
        big_sq_norm,
        big_batch(optimizer, total_weight),
        *(average.value for average in _averages(window)),
        window.largest_noise_scale.value,
    ]
    known = [concrete_value(value) for value in inputs]
    if all(value is not None for value in known):
        # Eagerly, a dozen scalars: their arithmetic on the host, where
        # each `keras.ops` call is a dispatch or more.
        values = _new_values(optimizer, _OnHost, [float(v) for v in known])
        values = [np.float32(value) for value in values]
    else:
        values = _new_values(optimizer, ops, inputs)
    written = (
        window.window_gradient_sq_norm,
        window.window_noise_trace,
        *_averages(window),
        window.largest_noise_scale,
    )
    _backend.assign(zip(written, values))


class _OnHost:
    """What `_new_values` calls of `keras.ops`, on Python floats (IEEE
    float64, as numpy's scalars, without a ufunc's cost per call). Every
    division it makes is by a value its `where` made nonzero."""

    where = staticmethod(lambda condition, x, y: x if condition else y)
    divide = staticmethod(operator.truediv)
    subtract = staticmethod(operator.sub)
    multiply = staticmethod(operator.mul)
    greater_equal = staticmethod(operator.ge)
    logical_and = staticmethod(lambda x, y: bool(x) and bool(y))
    isfinite = staticmethod(math.isfinite)

    @staticmethod
    def maximum(x, y):
        # NaN wins, as in numpy.
        return math.nan if math.isnan(x) or math.isnan(y) else max(x, y)


def _new_values(optimizer, xp, inputs):
    """The values `close` writes (the window's two estimates, the three
    averages, the largest noise scale), from its `inputs`, in `xp`
    (`_OnHost` or `keras.ops`)."""
    (
        sq_norm_sum,
        inverse_weight_sum,
        count,
        big_sq_norm,
        batch_big,
        *averages,
        largest,
    ) = inputs
    gradient_sq_norm, trace, valid = _window_estimates(
        xp, sq_norm_sum, inverse_weight_sum, count, big_sq_norm, batch_big
    )
    nan = float("nan")
    momentum = optimizer.noise_scale_momentum
    averages = [
        xp.where(valid, momentum * average + (1.0 - momentum) * value, average)
        for average, value in zip(averages, (gradient_sq_norm, trace, 1.0))
    ]
    noise_scale = _ratio(xp, *averages)
    counted = xp.logical_and(valid, ready(optimizer, averages[2], xp))
    return (
        xp.where(valid, gradient_sq_norm, nan),
        xp.where(valid, trace, nan),
        *averages,
        xp.where(counted, xp.maximum(largest, noise_scale), largest),
    )


def big_batch(optimizer, total_weight):
    """`B_big`, the window's weight in the noise scale's unit, from its
    total weight (over replicas, divided by their count): the replicas'
    shares' total weight."""
    batch_big = ops.cast(total_weight, "float32")
    replicas = _backend.replica_count(optimizer)
    if replicas > 1:
        batch_big = ops.multiply(batch_big, float(replicas))
    return batch_big


def ready(optimizer, weight, xp=ops):
    """Whether averages of total `weight` hold the `warmup_windows` of a
    `by_noise_scale` schedule (any estimate without one): the first
    estimates are too noisy to grow a window on (in `xp`, `_OnHost` or
    `keras.ops`)."""
    schedule = optimizer._accum_schedule
    warmup = 0
    if schedules.keyed_on_noise_scale(schedule):
        warmup = schedule.warmup_windows
    return xp.greater_equal(
        weight, _warm_weight(optimizer.noise_scale_momentum, warmup)
    )


def schedule_key(optimizer, schedule):
    """What a `by_noise_scale` schedule is keyed on: the largest noise
    scale measured since its warm-up (`grow_only`) or the current one (NaN
    before its warm-up ends)."""
    if not optimizer.built or not optimizer._has_window:
        return ops.convert_to_tensor(float("nan"), "float32")
    window = optimizer._window
    if schedule.grow_only:
        return window.largest_noise_scale.value
    is_ready = ready(optimizer, window.noise_average_weight.value)
    return ops.where(is_ready, read(optimizer, "noise_scale"), float("nan"))


def read(optimizer, what):
    """One read-out (`noise_scale`, `gradient_sq_norm`,
    `gradient_noise_trace`, `window_gradient_sq_norm`,
    `window_noise_trace`) as a float32 scalar, NaN where not measured."""
    if not (
        optimizer.built
        and optimizer._has_window
        and optimizer._window.measures_noise
    ):
        return ops.convert_to_tensor(float("nan"), "float32")
    window = optimizer._window
    if what == "window_gradient_sq_norm":
        return ops.convert_to_tensor(window.window_gradient_sq_norm)
    if what == "window_noise_trace":
        return ops.convert_to_tensor(window.window_noise_trace)
    sq_norm, trace, weight = (average.value for average in _averages(window))
    if what == "noise_scale":
        return _ratio(ops, sq_norm, trace, weight)
    value = sq_norm if what == "gradient_sq_norm" else trace
    nan = ops.convert_to_tensor(float("nan"), "float32")
    return ops.where(weight > 0, ops.divide(value, weight), nan)


def _averages(window):
    """The moving averages of `|G|^2` and `tr(Sigma)` and their total
    weight."""
    return (
        window.gradient_sq_norm_average,
        window.noise_trace_average,
        window.noise_average_weight,
    )


def _ratio(xp, sq_norm, trace, weight):
    """`trace / sq_norm` of two averages of total `weight`: NaN without an
    estimate, infinite where the average `|G|^2` is not positive (in
    `xp`, `_OnHost` or `keras.ops`)."""
    ratio = xp.where(
        sq_norm > 0,
        xp.divide(trace, xp.where(sq_norm > 0, sq_norm, 1.0)),
        float("inf"),
    )
    return xp.where(weight > 0, ratio, float("nan"))


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
    sq_norm, trace, weight = (
        float(values[name])
        for name in (
            "gradient_sq_norm_average",
            "noise_trace_average",
            "noise_average_weight",
        )
    )
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
    xp, sq_norm_sum, inverse_weight_sum, count, big_sq_norm, total_weight
):
    """`(|G|^2, tr(Sigma), valid)`: the paper's two unbiased estimates from
    a window's micro-batch gradients and their mean.

    Args:
        xp: `_OnHost` or `keras.ops`, which computes them.
        sq_norm_sum: the sum of its micro-batches' squared gradient norms.
        inverse_weight_sum: the sum of `1 / n_j`, their weights'.
        count: how many micro-batches it holds (`m`; under tf.distribute,
            the replicas' shares).
        big_sq_norm: the squared norm of its mean gradient.
        total_weight: its total weight, `B_big`.

    `B_small = m / sum(1 / n_j)`; `valid` is false for a window of one
    micro-batch, or whose estimates are not finite.
    """
    small_sq_norm = xp.divide(sq_norm_sum, xp.maximum(count, 1.0))
    batch_small = xp.divide(
        count, xp.where(inverse_weight_sum > 0, inverse_weight_sum, 1.0)
    )
    batch_big = total_weight
    gap = xp.subtract(batch_big, batch_small)
    spread = xp.where(gap > 0, gap, 1.0)
    gradient_sq_norm = xp.divide(
        xp.subtract(
            xp.multiply(batch_big, big_sq_norm),
            xp.multiply(batch_small, small_sq_norm),
        ),
        spread,
    )
    trace = xp.divide(
        xp.multiply(
            xp.subtract(small_sq_norm, big_sq_norm),
            xp.multiply(batch_small, batch_big),
        ),
        spread,
    )
    valid = xp.logical_and(
        xp.logical_and(count >= 2.0, gap > 0),
        xp.logical_and(xp.isfinite(gradient_sq_norm), xp.isfinite(trace)),
    )
    return gradient_sq_norm, trace, valid
