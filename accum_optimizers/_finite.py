"""Whether a micro-batch's gradients are all finite (`skip_nonfinite`), and
the masking of a skipped micro-batch in compiled code.

One `sum` per gradient answers for nearly every micro-batch: a sum is not
finite whenever a term is not (NaN propagates; an infinity stays one or
meets its opposite and makes NaN), and it is the cheapest reduction of
every backend, a fraction of `isfinite(...).all()`, which reads a boolean
per entry. Finite entries can overflow into an infinite sum, so the exact
test runs only when a sum is not finite (a Python branch eagerly; in
compiled code a conditional returning one bool, so XLA copies nothing).
"""

import numpy as np
from keras import backend
from keras import ops

from accum_optimizers._validation import LOW_PRECISION_DTYPES
from accum_optimizers._validation import concrete_value


def all_finite(grads, squares=None):
    """Whether every entry of every gradient (`None`s and the indices of
    `IndexedSlices` ignored) is finite: a Python `bool` where the
    gradients are concrete, else a traced scalar bool.

    Args:
        grads: the gradients (or `None`s).
        squares: Optional float32 vector of the gradients' sums of
            squares (`sums_of_squares`), already computed for the noise
            scale: a sum of squares is not finite where an entry is not,
            so they answer instead of a pass of sums of their own.
    """
    present = [grad for grad in grads if grad is not None]
    if not present:
        return True
    known_squares = None if squares is None else concrete_value(squares)
    if known_squares is not None:
        # Eagerly, one read of a few numbers to the host, where two
        # `keras.ops` calls are a dispatch or more each.
        probably = bool(np.isfinite(known_squares).all())
    elif squares is not None:
        probably = ops.all(ops.isfinite(squares))
    else:
        probably = _sums_are_finite(_values(present))
    known = concrete_value(probably)
    if known is not None:
        return bool(known) or bool(
            concrete_value(_exactly_finite(_values(present)))
        )
    return ops.cond(
        probably,
        lambda: ops.convert_to_tensor(True),
        lambda: _exactly_finite(_values(present)),
    )


def _values(grads):
    """The gradients' entries, in float32 at least: made only where read
    (eagerly each dtype's check is a dispatch)."""
    return [_wide(_entries(grad)) for grad in grads]


def sums_of_squares(grads):
    """A float32 vector: the sum of squares of each gradient's entries,
    `None`s left out (an `IndexedSlices`' values: the caller merges
    repeated indices first)."""
    squares = [
        ops.sum(ops.square(ops.cast(_entries(grad), "float32")))
        for grad in grads
        if grad is not None
    ]
    return ops.stack(squares) if squares else ops.zeros((0,), "float32")


def masked(value, finite):
    """`value` where `finite` (a traced scalar bool) holds, else zeros;
    `value` itself when `finite` is `None`."""
    if finite is None or value is None:
        return value
    if hasattr(value, "dense_shape"):  # tf.IndexedSlices
        values = ops.where(finite, value.values, ops.zeros_like(value.values))
        return type(value)(values, value.indices, value.dense_shape)
    value = ops.convert_to_tensor(value)
    return ops.where(finite, value, ops.zeros_like(value))


def _sums_are_finite(values):
    return ops.all(ops.isfinite(ops.stack([ops.sum(v) for v in values])))


def _exactly_finite(values):
    return ops.all(
        ops.stack([ops.all(ops.isfinite(value)) for value in values])
    )


def _entries(grad):
    """A gradient's entries: an `IndexedSlices`' values, or itself."""
    return grad.values if hasattr(grad, "dense_shape") else grad


def _wide(value):
    """float16 and bfloat16 entries, summed in float32 (the cast fuses into
    the sum under XLA): their own range overflows at ordinary sizes."""
    if backend.standardize_dtype(value.dtype) in LOW_PRECISION_DTYPES:
        return ops.cast(value, "float32")
    return value
