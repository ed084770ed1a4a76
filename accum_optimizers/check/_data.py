"""The checks of `check_exactness`'s data and counts, before it trains."""

import keras
import numpy as np


def check_positive_int(name, value):
    if (
        not isinstance(value, (int, np.integer))
        or isinstance(value, bool)
        or value < 1
    ):
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
        )


def sample_count(x, y, sample_weight):
    """The number of samples, the same in every array of x, y and
    sample_weight (else `ValueError`)."""
    lengths = []  # (name, samples) of every array
    for name, data in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        if data is None:
            continue
        for leaf in keras.tree.flatten(data):
            if np.ndim(leaf) == 0:
                raise ValueError(
                    f"`{name}` must be arrays (or a list or dict of "
                    "arrays) with one entry per sample, which the check "
                    "slices into its batches. Received: "
                    f"{name}={leaf!r} of type {type(leaf).__name__}"
                )
            lengths.append((name, len(leaf)))
    if len({count for _, count in lengths}) != 1:
        received = dict.fromkeys(f"len({n})={c}" for n, c in lengths)
        raise ValueError(
            "`x`, `y` and `sample_weight` must hold the same number of "
            f"samples. Received: {', '.join(received) or 'no arrays'}"
        )
    return lengths[0][1]


def check_input_shapes(model, x):
    """Refuses arrays of `x` that a Sequential or Functional `model` cannot
    take, before any training (a model class of your own declares no
    inputs; a dict of arrays is matched by Keras by name, not checked)."""
    inputs = getattr(model, "inputs", None)
    if not inputs or isinstance(x, dict):
        return
    arrays = keras.tree.flatten(x)
    if len(arrays) != len(inputs):
        raise ValueError(
            f"`x` must hold one array per model input ({len(inputs)}). "
            f"Received: {len(arrays)} arrays"
        )
    for array, expected in zip(arrays, inputs):
        shape = tuple(np.shape(array))
        if not _fits(shape[1:], tuple(expected.shape)[1:]):
            raise ValueError(
                f"`x` does not fit the model's input {expected.name!r} of "
                f"shape {tuple(expected.shape)}. Received: x.shape={shape}"
            )


def _fits(shape, expected):
    """Whether one sample of `shape` fits `expected` (`None`: any size),
    allowing the trailing axis of 1 that Keras' Functional adds or drops."""
    if len(shape) == len(expected) + 1 and shape[-1:] == (1,):
        shape = shape[:-1]
    elif len(shape) == len(expected) - 1 and expected[-1:] == (1,):
        expected = expected[:-1]
    return len(shape) == len(expected) and all(
        e is None or s == e for s, e in zip(shape, expected)
    )
