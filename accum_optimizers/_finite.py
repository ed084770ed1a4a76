"""Whether a micro-batch's gradients are all finite (`skip_nonfinite`), and
the masking of a skipped micro-batch in compiled code.

One `sum` per gradient answers it: a sum is non-finite whenever one of its
terms is (NaN propagates; an infinity stays one, or meets the opposite one
and makes NaN). Finite terms could overflow into an infinite sum, so each
entry is first multiplied by 2**-100, exactly (a power of two): no sum of
fewer than 10**30 finite float32 entries then overflows, and infinities and
NaN stay what they are. A sum is the cheapest reduction every backend has
(a fraction of `isfinite(...).all()`, which materialises or reads a boolean
per entry), and the multiply fuses into it under XLA.
"""

from keras import backend
from keras import ops

from accum_optimizers._validation import concrete_value

_NARROW = ("float16", "bfloat16")
# float32's largest finite value times this is below 3e8.
_SHRINK = 2.0**-100


def all_finite(grads):
    """Whether every entry of every gradient (`None`s and the indices of
    `IndexedSlices` ignored) is finite: a Python `bool` where the
    gradients are concrete, else a traced scalar bool."""
    sums = [
        ops.sum(ops.multiply(_wide(_entries(grad)), _SHRINK))
        for grad in grads
        if grad is not None
    ]
    if not sums:
        return True
    finite = ops.all(ops.isfinite(ops.stack(sums)))
    known = concrete_value(finite)
    return finite if known is None else bool(known)


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


def _entries(grad):
    """A gradient's entries: an `IndexedSlices`' values, or itself."""
    return grad.values if hasattr(grad, "dense_shape") else grad


def _wide(value):
    """float16 and bfloat16 entries, summed in float32 (the cast fuses into
    the sum under XLA): shrunk by 2**-100 they would underflow to zero in
    their own dtype, and a NaN sum of zeros is impossible, but an infinite
    entry would stay infinite either way; float32 keeps the sum honest."""
    if backend.standardize_dtype(value.dtype) in _NARROW:
        return ops.cast(value, "float32")
    return value
