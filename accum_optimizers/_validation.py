"""Checks of the accumulation arguments: at construction, and of the
`weight` of each `apply` (and whether a window may be weighed at all)."""

import math
import numbers

import numpy as np
from keras import backend
from keras import ops

from accum_optimizers import _keras_private

ACCUMULATOR_DTYPES = ("float16", "bfloat16", "float32", "float64")

# Dtypes whose range overflows at ordinary gradient sums: summed in float32.
LOW_PRECISION_DTYPES = ("float16", "bfloat16")

# The smallest weight float32 holds at full precision.
MIN_WEIGHT = float(np.finfo(np.float32).tiny)

# Counters are int32 on every backend.
MAX_ACCUM_ITERS = 2**31 - 1


def is_real_number(value):
    """Whether `value` is a real number: a Python or numpy integer or
    floating scalar (`numbers.Real`), not a bool (which `numbers` counts as
    an integer)."""
    return isinstance(value, numbers.Real) and not isinstance(
        value, (bool, np.bool_)
    )


def is_integer(value):
    """Whether `value` is a Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(
        value, (bool, np.bool_)
    )


def plain_number(value):
    """`value` (a real number) as a Python `int` or `float`: what configs
    hold (JSON has no numpy scalars)."""
    return int(value) if is_integer(value) else float(value)


def validate_accum_iters(accum_iters):
    """Returns `accum_iters` as a plain `int` in `[1, 2**31 - 1]`.

    Accepts Python and numpy integers (tuners supply `numpy.int64`); refuses
    anything else, floats included, naming the value.
    """
    if not is_integer(accum_iters):
        raise TypeError(
            "`accum_iters` must be an integer >= 1. Received: "
            f"accum_iters={accum_iters!r} "
            f"(of type {type(accum_iters).__name__})"
        )
    if not 1 <= accum_iters <= MAX_ACCUM_ITERS:
        raise ValueError(
            f"`accum_iters` must be an integer in [1, {MAX_ACCUM_ITERS}]. "
            f"Received: accum_iters={accum_iters!r}"
        )
    return int(accum_iters)


def validate_positive_ints(**values):
    """Raises `ValueError`, naming the argument and its value, unless each
    of `values` (by argument name) is an integer in `[1, 2**31 - 1]`."""
    for name, value in values.items():
        try:
            validate_accum_iters(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
            ) from None


def validate_boundaries(boundaries):
    """`{update: k}` with int keys (JSON's string keys converted), sorted.

    Raises naming `accum_iters` unless it is non-empty, has the key 0,
    non-negative integer keys and integer values >= 1.
    """
    problem = None
    if not isinstance(boundaries, dict) or not boundaries:
        problem = "must be a non-empty dict"
    else:
        converted = {}
        for key, value in boundaries.items():
            if isinstance(key, str) and key.isdigit():
                key = int(key)
            if not is_integer(key) or key < 0:
                problem = f"has a key that is not an integer >= 0: {key!r}"
                break
            try:
                converted[int(key)] = validate_accum_iters(value)
            except (TypeError, ValueError):
                problem = f"maps {key!r} to {value!r}, not an integer >= 1"
                break
        else:
            if 0 not in converted:
                problem = "has no key 0 (the window size from the start)"
    if problem:
        raise ValueError(
            "`accum_iters` as a schedule is a dict {applied updates: "
            "window size} whose first key is 0; this one "
            f"{problem}. Received: "
            f"accum_iters={boundaries!r}"
        )
    return dict(sorted(converted.items()))


def validate_accumulator_dtype(accumulator_dtype):
    """Returns the standardized dtype name, or `None`."""
    if accumulator_dtype is None:
        return None
    try:
        dtype = backend.standardize_dtype(accumulator_dtype)
    except (ValueError, TypeError, AttributeError):
        dtype = None
    if dtype not in ACCUMULATOR_DTYPES:
        raise ValueError(
            f"`accumulator_dtype` must be one of {ACCUMULATOR_DTYPES} or "
            f"`None`. Received: accumulator_dtype={accumulator_dtype!r}"
        )
    return dtype


def validate_decay(decay):
    """Returns the Keras 2 time decay as a float, or `None` for no decay."""
    if decay is None:
        return None
    valid = is_real_number(decay) and math.isfinite(decay) and decay >= 0
    with np.errstate(over="ignore"):
        valid = valid and math.isfinite(np.float32(decay))
    if not valid:
        raise ValueError(
            "`decay` must be a finite number >= 0 (representable in "
            f"float32). Received: decay={decay!r}"
        )
    return float(decay) or None


def concrete_value(value):
    """`value` as a numpy array, or `None` while it is being traced (a
    symbolic TensorFlow tensor, a JAX tracer, a tensor under
    torch.compile)."""
    if isinstance(value, (numbers.Number, np.ndarray, np.generic)):
        return np.asarray(value)
    if _keras_private.torch_compiling():
        return None
    host = _keras_private.torch_host_value(value)
    if host is not None:
        return host
    if _keras_private.in_tf_graph():
        return None  # and no numpy warning of a symbolic tensor
    try:
        return np.asarray(ops.convert_to_numpy(value))
    except Exception:  # noqa: BLE001 (each backend raises its own type)
        return None


def validate_weight(value, weight, zero_allowed=False):
    """Returns `weight` (whose numpy value is `value`) as a Python float, or
    raises unless it is a finite real number > 0 (or `0`, with
    `zero_allowed`)."""
    valid = (
        value.shape == ()
        and value.dtype.kind in "iuf"
        and bool(np.isfinite(value))
        and (value > 0 or (zero_allowed and value == 0))
    )
    if valid and value != 0:
        # The window's total weight is a float32 sum of weights.
        with np.errstate(over="ignore", under="ignore"):
            single = np.float32(value)
        valid = bool(np.isfinite(single)) and single >= MIN_WEIGHT
    if not valid:
        raise ValueError(
            "`weight` must be a finite number > 0 that float32 holds (from "
            f"{MIN_WEIGHT:.3g} to {np.finfo(np.float32).max:.3g}: the "
            "micro-batch's sample count, sum of sample weights or token "
            f"count). Received: weight={weight!r}"
        )
    return float(np.float32(value))


def validate_weighable(accumulator_dtype):
    """Refuses weights (`weight=`, `weigh_micro_batches`) where a window
    sums in float16: `weight * grad` overflows float16's range (65504) at
    token counts.

    Args:
        accumulator_dtype: the `accumulator_dtype` of an optimizer with a
            window.
    """
    if accumulator_dtype == "float16":
        raise ValueError(
            "Weighted windows (`weight=`, `weigh_micro_batches`) need an "
            "accumulator with float32's range: a weighted gradient "
            "overflows float16. Pass accumulator_dtype='bfloat16', "
            "'float32' or None. Received: accumulator_dtype='float16'"
        )


def validate_loss(loss):
    """Returns `loss` (a micro-batch's loss, for `window_loss`) as a float32
    scalar tensor, or `None`; raises naming `loss` unless it is a real
    scalar, before any state changes."""
    if loss is None:
        return None
    problem = None
    if isinstance(loss, (str, bytes)):
        problem = "a string"
    else:
        try:
            tensor = ops.convert_to_tensor(loss)
            dtype = backend.standardize_dtype(tensor.dtype)
        except Exception:  # noqa: BLE001 (each backend raises its own type)
            dtype = None
        if dtype is None or not (
            dtype.startswith(("float", "int", "uint")) or dtype == "bool"
        ):
            problem = f"of dtype {dtype}"
        elif tensor.shape is not None and len(tensor.shape) not in (0, None):
            if any(d != 1 for d in tensor.shape) or None in tensor.shape:
                problem = f"of shape {tuple(tensor.shape)}"
    if problem is not None:
        raise ValueError(
            "`loss` must be a real scalar: the micro-batch's loss, for "
            f"`window_loss`. Received: loss={loss!r}, {problem}"
        )
    if dtype == "float32" and tuple(tensor.shape) == ():
        return tensor  # already so: eager backends pay each op a dispatch
    return ops.reshape(ops.cast(tensor, "float32"), ())


def validate_gradient_shape(grad, variable):
    """Raises unless `grad`'s static shape fits `variable`'s exactly."""
    if hasattr(grad, "dense_shape"):  # tf.IndexedSlices
        shape = getattr(grad.values, "shape", None)
        shape = None if shape is None else shape[1:]
        expected = tuple(variable.shape)[1:]
    else:
        shape = getattr(grad, "shape", None)
        expected = tuple(variable.shape)
    if shape is None:
        return
    try:
        dims = tuple(shape)
    except ValueError:  # a TensorFlow shape of unknown rank
        return
    dims = tuple(None if d is None else int(d) for d in dims)
    fits = len(dims) == len(expected) and all(
        d is None or d == e for d, e in zip(dims, expected)
    )
    if not fits:
        raise ValueError(
            f"The gradient for variable '{variable.path}' has shape "
            f"{dims}, but the variable has shape {expected}; they must be "
            "equal (a gradient is never broadcast)."
        )


def validate_gradient_dtype(grad, variable):
    """Raises unless `grad` (a tensor, an array or a `tf.IndexedSlices`)
    has a floating-point dtype, which the cast into the window's sum takes.

    A string gradient fails in that cast and an integer one is not a
    gradient; either would fail or round after the window's counters were
    written.
    """
    dtype = getattr(grad, "dtype", None)
    if dtype is None:  # a list or a Python number
        dtype = np.asarray(grad).dtype
    try:
        name = backend.standardize_dtype(dtype)
    except (ValueError, TypeError, AttributeError):
        name = getattr(dtype, "name", str(dtype))
    if not name.startswith(("float", "bfloat")):
        raise ValueError(
            f"The gradient for variable '{variable.path}' has dtype {name}, "
            "but a gradient must have a floating-point dtype (it is cast to "
            "the window's sum, of a float dtype)."
        )


def validate_gradient_indices(grad, variable):
    """Raises unless a concrete `tf.IndexedSlices` gradient's indices are
    rows of `variable`, `[0, rows)`: the scatter into the window's sum
    would write the rows before the first one out of range, and fail.
    Traced indices are not checked (the graph's scatter fails on them)."""
    if not hasattr(grad, "dense_shape"):  # not a tf.IndexedSlices
        return
    indices = concrete_value(grad.indices)
    if indices is None or indices.size == 0:
        return
    rows = tuple(variable.shape)[0]
    if indices.min() < 0 or indices.max() >= rows:
        raise ValueError(
            f"The gradient for variable '{variable.path}' is a "
            f"`tf.IndexedSlices` whose indices must be in [0, {rows}), the "
            "variable's rows. Received: indices from "
            f"{indices.min()} to {indices.max()}"
        )


def validate_gradient(grad, variable):
    """Raises unless `grad` can be added into `variable`'s sum: its shape,
    its dtype and, for a `tf.IndexedSlices`, its indices."""
    validate_gradient_shape(grad, variable)
    validate_gradient_dtype(grad, variable)
    validate_gradient_indices(grad, variable)
