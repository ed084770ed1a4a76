"""Whether a micro-batch's gradients are all finite (`skip_nonfinite`), and
the masking of a skipped micro-batch in compiled code.

A sum is non-finite whenever one of its terms is (NaN propagates; an
infinity stays one, or meets the opposite one and makes NaN), so one
`sum` per gradient answers "finite" for nearly every micro-batch. It is the
cheapest reduction every backend has (a fraction of `isfinite(...).all()`,
which materialises or reads a boolean per entry). Only when a sum is not
finite, which finite entries may also produce by overflowing, does the
exact test run, under a conditional.
"""

from keras import backend
from keras import ops

from accum_optimizers._validation import concrete_value

_NARROW = ("float16", "bfloat16")


def all_finite(grads):
    """A scalar bool: whether every entry of every gradient (`None`s and
    the indices of `IndexedSlices` ignored) is finite; a Python `bool`
    where the gradients are concrete."""
    values = [_entries(grad) for grad in grads if grad is not None]
    if not values:
        return True
    sums = [ops.cast(ops.sum(_wide(value)), "float32") for value in values]
    probably = ops.all(ops.isfinite(ops.stack(sums)))
    known = concrete_value(probably)
    if known is not None:
        return bool(known) or bool(concrete_value(_exactly_finite(values)))
    return ops.cond(
        probably,
        lambda: ops.convert_to_tensor(True),
        lambda: _exactly_finite(values),
    )


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


def _exactly_finite(values):
    return ops.all(
        ops.stack([ops.all(ops.isfinite(value)) for value in values])
    )


def _entries(grad):
    """A gradient's entries: an `IndexedSlices`' values, or itself."""
    return grad.values if hasattr(grad, "dense_shape") else grad


def _wide(value):
    """float16 and bfloat16 sums overflow at ordinary magnitudes: sum them
    in float32 (the cast fuses into the sum under XLA)."""
    if backend.standardize_dtype(value.dtype) in _NARROW:
        return ops.cast(value, "float32")
    return value
