"""Checks of the accumulation arguments, run at construction."""

import math
import numbers

import numpy as np
from keras import backend

ACCUMULATOR_DTYPES = ("float16", "bfloat16", "float32", "float64")

# Counters are int32 on every backend.
MAX_ACCUM_ITERS = 2**31 - 1


def validate_accum_iters(accum_iters):
    """Returns `accum_iters` as a plain `int` in `[1, 2**31 - 1]`.

    Accepts Python and numpy integers (tuners supply `numpy.int64`); refuses
    anything else, floats included, naming the value.
    """
    if isinstance(accum_iters, (bool, np.bool_)) or not isinstance(
        accum_iters, numbers.Integral
    ):
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
    valid = (
        isinstance(decay, numbers.Real)
        and not isinstance(decay, (bool, np.bool_))
        and math.isfinite(decay)
        and decay >= 0
    )
    with np.errstate(over="ignore"):
        valid = valid and math.isfinite(np.float32(decay))
    if not valid:
        raise ValueError(
            "`decay` must be a finite number >= 0 (representable in "
            f"float32). Received: decay={decay!r}"
        )
    return float(decay) or None
