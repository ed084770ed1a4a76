"""What an accumulating optimizer can take when an accumulation argument is
set as an attribute (`_args.Attribute`), after its value passed the
constructor's check.

Each function maps `(optimizer, value)` to the value kept, and raises,
naming the argument and the value, where the optimizer cannot take it now:
what its `build` made (the window's variables, the sums' dtype) is fixed.
A value that a compiled train function reads when it is traced warns,
where it changes after the build, that such a function keeps the old one.
"""

import warnings

import keras

from accum_optimizers import schedules
from accum_optimizers._window import adascale


def taken(optimizer, value):
    """A value the optimizer takes at any time, read afresh when a train
    function is traced."""
    return value


def traced(name):
    """The check of `name`, read when a compiled train function is traced:
    warns where it changes after the build."""

    def check(optimizer, value):
        _warn_if_traced(optimizer, name, value)
        return value

    return check


def accum_iters(optimizer, value):
    """`accum_iters`: a `{update: k}` dict kept as a dict; refused where
    keyed on a noise scale the optimizer does not measure, beside Keras'
    own `gradient_accumulation_steps`, and where the optimizer was built
    without a window."""
    if isinstance(value, schedules.PiecewiseConstantAccumIters):
        value = dict(value.boundaries)
    if schedules.keyed_on_noise_scale(value) and not getattr(
        optimizer, "measure_noise_scale", True
    ):
        raise ValueError(
            "`accum_iters=by_noise_scale(...)` follows the measured "
            "noise scale: pass `measure_noise_scale=True` too. Received: "
            f"accum_iters={value!r}, measure_noise_scale=False"
        )
    windows = not isinstance(value, int) or value > 1
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if windows and steps:
        raise ValueError(
            "Pass either `accum_iters` or Keras' own "
            "`gradient_accumulation_steps`, not both: together they would "
            f"accumulate twice. Received: accum_iters={value!r}, "
            f"gradient_accumulation_steps={steps!r}"
        )
    layout = _layout(optimizer)
    if layout is not None and layout.has_window:
        _check_pending_fits(optimizer, value)
    elif layout is not None and windows:
        raise _built_without_window(optimizer, "accum_iters", value)
    _warn_if_traced(optimizer, "accum_iters", value)
    return value


def skip_nonfinite(optimizer, value):
    """`skip_nonfinite`: `True` needs the window's state, made by `build`."""
    layout = _layout(optimizer)
    if value and layout is not None and not layout.has_window:
        raise _built_without_window(optimizer, "skip_nonfinite", value)
    _warn_if_traced(optimizer, "skip_nonfinite", value)
    return value


def measure_noise_scale(optimizer, value):
    """`measure_noise_scale`: `True` needs the measurement's variables,
    made by `build`; `False` is refused where the window size or the
    learning rate follows the measurement."""
    layout = _layout(optimizer)
    if value and layout is not None:
        if not any(variable.noise_scale for variable in layout.state):
            raise ValueError(
                f"Cannot set `measure_noise_scale` of '{optimizer.name}' "
                "to True: it was built without the measurement's "
                "variables. Pass `measure_noise_scale=True` when making "
                f"the optimizer. Received: measure_noise_scale={value!r}"
            )
    accum_iters = optimizer.__dict__.get(key("accum_iters"))
    if not value and schedules.keyed_on_noise_scale(accum_iters):
        raise ValueError(
            "`accum_iters=by_noise_scale(...)` follows the measured noise "
            "scale: it needs `measure_noise_scale=True`. Received: "
            f"measure_noise_scale={value!r}, accum_iters={accum_iters!r}"
        )
    adascale.check_measured(optimizer, value)
    _warn_if_traced(optimizer, "measure_noise_scale", value)
    return value


def accumulator_dtype(optimizer, value):
    """`accumulator_dtype`: the sums are made in it by `build`."""
    kept = optimizer.__dict__.get(key("accumulator_dtype"))
    if _layout(optimizer) is not None and value != kept:
        raise ValueError(
            f"Cannot set `accumulator_dtype` of '{optimizer.name}' to "
            f"{value!r}: it was built with accumulator_dtype={kept!r}, "
            "which its sums are made in. Set it before the optimizer is "
            "built (before the first `fit` or `apply`), or make a new "
            f"optimizer. Received: accumulator_dtype={value!r}"
        )
    return value


def lr(optimizer, value):
    """`lr`, Keras 2's alias of `learning_rate`: sets it, warning."""
    if value is not None:
        warnings.warn(
            "`lr` is the Keras 2 spelling of `learning_rate`; set "
            "`learning_rate` instead.",
            DeprecationWarning,
            stacklevel=4,
        )
        optimizer.learning_rate = value
    return None


def key(name):
    """Where an optimizer keeps the value of the argument `name`."""
    return f"_accum_arg_{name}"


def _layout(optimizer):
    """The optimizer's `Layout` once built, else `None`."""
    return optimizer.__dict__.get("_accum_layout")


def _built_without_window(optimizer, name, value):
    return ValueError(
        f"Cannot set `{name}` of '{optimizer.name}' to {value!r}: it was "
        "built with accum_iters=1, without the window's state (its sums "
        f"and counters). Set `{name}` before the optimizer is built "
        "(before the first `fit` or `apply`), or make a new optimizer. "
        f"Received: {name}={value!r}"
    )


def _check_pending_fits(optimizer, accum_iters):
    """Raises where `optimizer` (built, with a window) holds more pending
    micro-batches than a window of `accum_iters` (an int) continues, as a
    load into it would."""
    if not isinstance(accum_iters, int):
        return
    try:
        micro_steps = optimizer._window.micro_steps
        pending = int(keras.ops.convert_to_numpy(micro_steps))
    except Exception:  # noqa: BLE001 - traced: nothing to read
        return
    if pending >= accum_iters:
        raise ValueError(
            f"Cannot set `accum_iters` of '{optimizer.name}' to "
            f"{accum_iters}: the optimizer holds a pending window of "
            f"{pending} micro-batches, more than a window of {accum_iters} "
            f"continues (at most {accum_iters - 1}). Call `flush()` first, "
            f"or set a larger value. Received: accum_iters={accum_iters}"
        )


def _warn_if_traced(optimizer, name, value):
    """Warns where `name` changes to `value` after the optimizer was
    built: a compiled train function keeps what it was traced with."""
    if _layout(optimizer) is None:
        return
    if value == optimizer.__dict__.get(key(name)):
        return
    warnings.warn(
        f"`{name}` of '{optimizer.name}' set to {value!r} after it was "
        "built: a train function already compiled (a `tf.function`, "
        "`jit_compile`, JAX) keeps the value it was traced with. Call "
        "`model.make_train_function(force=True)` before the next `fit`.",
        stacklevel=5,
    )
