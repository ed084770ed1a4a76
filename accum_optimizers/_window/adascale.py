"""A learning rate that follows the window, at the window's close: the
base steps the window about to be applied stands for (AdaScale's gain `r`,
or a scaling rule's `S`), and the scale-invariant step it advances (see
`_adascale_schedule.py` and `_scaling_rules.py` for the rules).

The gain is taken from the noise scale's moving averages of `|G|^2` and
`tr(Sigma)`, not from the window's own estimates: one window's estimates
are unbiased but noisy (its `|G|^2` is often negative), and a ratio of
noisy estimates is biased; AdaScale's authors average theirs the same way.
"""

import contextlib

import keras
import numpy as np
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers._adascale_schedule import follows_window
from accum_optimizers._adascale_schedule import is_adascale
from accum_optimizers._window import counts
from accum_optimizers._window import noise


def uses_adascale(optimizer):
    """Whether `optimizer`'s learning rate is an AdaScale one."""
    return is_adascale(_keras_private.learning_rate_as_given(optimizer))


def follows(optimizer):
    """Whether `optimizer`'s learning rate follows the window: AdaScale's,
    or a scaling rule's. It then carries the scale-invariant step."""
    return follows_window(_keras_private.learning_rate_as_given(optimizer))


def check(optimizer):
    """Raises where `optimizer` cannot take its AdaScale learning rate:
    the gain is derived for SGD (with or without momentum), and the
    adaptive optimizers' per-coordinate steps are not scaled by it."""
    if not uses_adascale(optimizer):
        return
    if not isinstance(optimizer, keras.optimizers.SGD):
        raise ValueError(
            "`learning_rate=adascale(...)` takes an SGD optimizer "
            "(`SGDAccumulate`): AdaScale's gain is derived for SGD with "
            "or without momentum, and measured only for it. Received: "
            f"{type(optimizer).__name__}(learning_rate="
            f"{_keras_private.learning_rate_as_given(optimizer)!r})"
        )


def check_not_in_multi_optimizer(multi_optimizer):
    """Raises where an optimizer of `multi_optimizer` (a `MultiOptimizer`
    of several) has a learning rate that follows the window: AdaScale's
    gain is the model's, from the noise of the whole gradient, and each
    inner optimizer measures only its own variables; a scaling rule's
    scale-invariant step is the model's clock, and each inner optimizer
    keeps a window of its own."""
    inner = multi_optimizer.optimizers
    scaled = [o for o in inner if follows(o)]
    if not scaled or len(inner) < 2:
        return
    given = _keras_private.learning_rate_as_given(scaled[0])
    if not uses_adascale(scaled[0]):
        raise ValueError(
            f"MultiOptimizer '{multi_optimizer.name}': its optimizer "
            f"'{scaled[0].name}' has a learning rate that follows the "
            f"window ({given!r}). Its scale-invariant "
            "step is the model's clock, and each optimizer inside a "
            "MultiOptimizer keeps a window of its own, whose windows may "
            "close apart (`by_noise_scale` sizes each from its own "
            "variables), so each would keep a clock of its own. Use it on "
            "one optimizer that trains the whole model, or give the "
            "MultiOptimizer's optimizers other learning rates."
        )
    raise ValueError(
        f"MultiOptimizer '{multi_optimizer.name}': its optimizer "
        f"'{scaled[0].name}' has an AdaScale learning rate "
        f"({given!r}). AdaScale's gain is the whole model's (from the "
        "noise of the whole gradient), and an optimizer "
        "inside a MultiOptimizer measures only its own variables, so each "
        "would take a gain of its own. Use `learning_rate=adascale(...)` "
        "on one optimizer that trains the whole model, or give the "
        "MultiOptimizer's optimizers other learning rates."
    )


def check_measured(optimizer, measure):
    """Raises where `optimizer` has an AdaScale learning rate and
    `measure` (`measure_noise_scale`) is false."""
    if not measure and uses_adascale(optimizer):
        raise ValueError(
            "`learning_rate=adascale(...)` scales the learning rate by the "
            "measured noise scale: pass `measure_noise_scale=True` too. "
            "Received: learning_rate="
            f"{_keras_private.learning_rate_as_given(optimizer)!r}, "
            f"measure_noise_scale={measure!r}"
        )


def read(optimizer, what):
    """`adascale_gain` (AdaScale's), `window_scale` (a scaling rule's) or
    `scale_invariant_step` (either's) as a float32 scalar, NaN without
    such a learning rate, `0` before the optimizer is built."""
    nan = ops.convert_to_tensor(float("nan"), "float32")
    if what == "scale_invariant_step":
        known = follows(optimizer)
    elif what == "adascale_gain":
        known = uses_adascale(optimizer)
    else:  # `window_scale`
        known = follows(optimizer) and not uses_adascale(optimizer)
    if not known:
        return nan
    window = optimizer._window
    if window is None:
        return ops.zeros((), "float32")
    if window.adascale_gain is None:
        return nan
    if what == "scale_invariant_step":
        return scale_invariant_step(optimizer)
    return ops.convert_to_tensor(window.adascale_gain)


def gain(sq_norm, trace, window_weight, base_batch_size):
    """AdaScale's gain `r` for a window of `window_weight` (float32
    scalars; `sq_norm` and `trace` the averages of `|G|^2` and
    `tr(Sigma)`, NaN before the first estimate), clipped to lie between
    1 and `S = window_weight / base_batch_size`; `1` without an estimate.

    A negative average counts 0: `|G|^2 <= 0` is the noise dominating
    (`r = S`), `tr(Sigma) <= 0` the gradient (`r = 1`). A window of weight
    0 holds no sample: `S = 0`, and it stands for no base step (`r = 0`),
    with or without an estimate."""
    scale = ops.divide(window_weight, float(base_batch_size))
    sq_norm = ops.maximum(sq_norm, 0.0)
    trace = ops.maximum(trace, 0.0)
    numerator = ops.add(ops.divide(trace, float(base_batch_size)), sq_norm)
    denominator = ops.add(ops.divide(trace, window_weight), sq_norm)
    known = ops.logical_and(
        ops.greater(denominator, 0.0), ops.isfinite(numerator)
    )
    ratio = ops.divide(numerator, ops.where(known, denominator, 1.0))
    ratio = ops.where(known, ratio, 1.0)
    ratio = ops.clip(ratio, ops.minimum(scale, 1.0), ops.maximum(scale, 1.0))
    return ops.where(ops.greater(window_weight, 0.0), ratio, 0.0)


def close(optimizer, window_weight):
    """Writes the base steps the window being applied stands for (its
    weight in the noise scale's unit, `window_weight`), before the
    parent's update reads the learning rate: AdaScale's gain, from the
    noise scale's averages (`noise.read`), or a scaling rule's `S`."""
    window = optimizer._window
    schedule = _keras_private.learning_rate_as_given(optimizer)
    if is_adascale(schedule):
        steps = gain(
            noise.read(optimizer, "gradient_sq_norm"),
            noise.read(optimizer, "gradient_noise_trace"),
            window_weight,
            schedule.base_batch_size,
        )
    else:
        steps = schedule.base_steps(window_weight)
    window.adascale_gain.assign(steps)


def advance(optimizer):
    """The writes of `scale_invariant_step +=` the base steps of the update
    (`adascale_gain`), after it: a compensated pair, as `samples_seen`."""
    window = optimizer._window
    return counts.add_compensated(
        window.scale_invariant_step,
        window.scale_invariant_step_error,
        window.adascale_gain.value,
    )


@contextlib.contextmanager
def applying(optimizer):
    """While the close applies the parent's update: its learning rate takes
    the window's gain or `S` as it is (`0` for a window of weight 0, the
    first included), not the rate between windows."""
    window = optimizer._window
    if not follows(optimizer):
        yield
        return
    window.closing = True
    try:
        yield
    finally:
        window.closing = False


def learning_rate(optimizer):
    """The learning rate of the update being applied: the rule's factor of
    its gain or `S` times the base rate at the scale-invariant step
    (between windows, the last update's, `1` before the first)."""
    window = optimizer._window
    if window is None:
        step, last_gain = ops.zeros((), "float32"), 1.0
    elif window.adascale_gain is None:
        raise ValueError(
            f"'{optimizer.name}' was built without the state of a learning "
            "rate that follows the window: pass `learning_rate=adascale("
            "...)` (or `linear_scaling(...)`, `sqrt_scaling(...)`) when "
            "making the optimizer, not after it was built."
        )
    else:
        step = scale_invariant_step(optimizer)
        last_gain = window.adascale_gain.value
        if not window.closing:
            # Between windows before the first update, a base step's rate.
            last_gain = ops.where(
                ops.greater(optimizer.iterations, 0), last_gain, 1.0
            )
    return _keras_private.learning_rate_as_given(optimizer).at(step, last_gain)


def start_at(window, updates):
    """Restores a state saved without the scale-invariant step (without
    AdaScale or a scaling rule): each update it applied was one step of
    the base schedule, of gain or `S` 1 (`0` before the first)."""
    window.scale_invariant_step.assign(np.asarray(updates, "float32"))
    window.scale_invariant_step_error.assign(np.zeros((), "float32"))
    gain = 1.0 if int(np.asarray(updates)) > 0 else 0.0
    window.adascale_gain.assign(np.asarray(gain, "float32"))


def scale_invariant_step(optimizer):
    """`tau`, the base schedule's progress, as one float32 scalar."""
    window = optimizer._window
    if window is None:
        return ops.zeros((), "float32")
    return ops.add(
        window.scale_invariant_step.value,
        window.scale_invariant_step_error.value,
    )
