"""Keras' own golden checks of Adam, SGD and RMSprop, through our classes.

The values are those of `keras/src/optimizers/{adam,sgd,rmsprop}_test.py`.
With `accum_iters=1` our classes must reproduce them as they are; with
`accum_iters=3`, each golden gradient g is fed as the three micro-gradients
g - d, g + 2d, g - d, whose mean is g, so the trajectory is the same.
"""

import keras
import numpy as np
import pytest
from keras import ops

from accum_optimizers import AdamAccumulate
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate

GOLDEN = {
    "adam_amsgrad": (
        AdamAccumulate,
        {"amsgrad": True},
        np.tile([[0.999], [0.9982], [0.9974], [0.9965], [0.9955]], (1, 10)),
    ),
    "rmsprop_centered": (
        RMSpropAccumulate,
        {"centered": True},
        np.tile([[0.9967], [0.9933], [0.9908], [0.9885], [0.9864]], (1, 10)),
    ),
    "sgd_nesterov": (
        SGDAccumulate,
        {"nesterov": True},
        np.array(
            [
                [0.9999] * 10,
                [0.9989, 0.9979, 0.9969, 0.9959, 0.9949]
                + [0.9939, 0.9929, 0.9919, 0.9909, 0.9899],
                [0.9979, 0.9959, 0.9939, 0.9919, 0.9899]
                + [0.9879, 0.9859, 0.9839, 0.9819, 0.9799],
                [0.9969, 0.9939, 0.9909, 0.9879, 0.9849]
                + [0.9819, 0.9789, 0.9759, 0.9729, 0.9699],
                [0.9959, 0.9919, 0.9879, 0.9839, 0.9799]
                + [0.9759, 0.9719, 0.9679, 0.9639, 0.9599],
            ]
        ),
    ),
}


def _feed(optimizer, grad, variable, accum_iters):
    if accum_iters == 1:
        optimizer.apply_gradients([(grad, variable)])
        return
    spread = ops.linspace(-0.05, 0.05, 10, dtype="float32")
    for offset in (-spread, 2 * spread, -spread):
        optimizer.apply_gradients([(grad + offset, variable)])


@pytest.mark.parametrize("accum_iters", [1, 3])
@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_correctness_with_keras_golden_values(case, accum_iters):
    cls, kwargs, golden = GOLDEN[case]
    optimizer = cls(accum_iters=accum_iters, **kwargs)
    x = keras.Variable(np.ones([10], dtype="float32"))
    grads = ops.arange(0.1, 1.1, 0.1, dtype="float32")[:10]
    first_grads = ops.full((10,), 0.01, dtype="float32")
    _feed(optimizer, first_grads, x, accum_iters)
    for i in range(5):
        np.testing.assert_allclose(
            ops.convert_to_numpy(x.value), golden[i], rtol=5e-4, atol=5e-4
        )
        _feed(optimizer, grads, x, accum_iters)


@pytest.mark.parametrize(
    "cls, expected",
    [
        (AdamAccumulate, [0.5, 1.5, 2.5, 3.5]),
        (SGDAccumulate, [0.5, -1.0, -0.5, 3.0]),
        (RMSpropAccumulate, [-0.5811, 0.4189, 1.4189, 2.4189]),
    ],
)
@pytest.mark.parametrize("accum_iters", [1, 2])
def test_single_step(cls, expected, accum_iters):
    optimizer = cls(learning_rate=0.5, accum_iters=accum_iters)
    grads = ops.array([1.0, 6.0, 7.0, 2.0], dtype="float32")
    variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
    for _ in range(accum_iters):
        optimizer.apply_gradients([(grads, variable)])
    np.testing.assert_allclose(
        ops.convert_to_numpy(variable.value), expected, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize(
    "cls", [AdamAccumulate, SGDAccumulate, RMSpropAccumulate]
)
@pytest.mark.parametrize("accum_iters", [1, 4])
def test_weight_decay_and_exclusions(cls, accum_iters):
    grads = ops.zeros((), dtype="float32")
    var1, var2, var3 = (
        keras.Variable(2.0),
        keras.Variable(2.0, name="exclude"),
        keras.Variable(2.0),
    )
    optimizer_1 = cls(
        learning_rate=1.0, weight_decay=0.004, accum_iters=accum_iters
    )
    optimizer_2 = cls(
        learning_rate=1.0, weight_decay=0.004, accum_iters=accum_iters
    )
    optimizer_2.exclude_from_weight_decay(var_names=["exclude"])
    optimizer_3 = cls(
        learning_rate=1.0, weight_decay=0.004, accum_iters=accum_iters
    )
    optimizer_3.exclude_from_weight_decay(var_list=[var3])
    for _ in range(accum_iters):
        optimizer_1.apply_gradients(zip([grads], [var1]))
        optimizer_2.apply_gradients(zip([grads, grads], [var1, var2]))
        optimizer_3.apply_gradients(zip([grads, grads], [var1, var3]))
    # Keras' value: one decay step of 2 * (1 - 0.004) per optimizer, and
    # var1 is decayed by all three optimizers.
    np.testing.assert_allclose(var1.numpy(), 1.9760959, rtol=0, atol=1e-6)
    np.testing.assert_allclose(var2.numpy(), 2.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(var3.numpy(), 2.0, rtol=0, atol=1e-6)
