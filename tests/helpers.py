"""Models, data and drawn optimizer configurations shared by the tests."""

import keras
import numpy as np
from hypothesis import strategies as st

from accum_optimizers import AdamAccumulate
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate

PARENTS = {
    AdamAccumulate: keras.optimizers.Adam,
    SGDAccumulate: keras.optimizers.SGD,
    RMSpropAccumulate: keras.optimizers.RMSprop,
}


def small_model(seed, in_dim=4, hidden=6, out_dim=2, activation="tanh"):
    """A small dense model with weights fixed by `seed`."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((in_dim,)),
            keras.layers.Dense(hidden, activation=activation),
            keras.layers.Dense(out_dim),
        ]
    )


def regression_data(seed, n, in_dim=4, out_dim=2):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype("float32")
    y = rng.normal(size=(n, out_dim)).astype("float32")
    return x, y


@st.composite
def optimizer_configs(draw):
    """Draws `(accumulating class, keyword arguments)` over every flag."""
    cls = draw(st.sampled_from(list(PARENTS)))
    if cls is AdamAccumulate:
        kwargs = {
            "learning_rate": draw(st.sampled_from([1e-3, 1e-2])),
            "beta_1": draw(st.sampled_from([0.8, 0.9])),
            "beta_2": draw(st.sampled_from([0.99, 0.999])),
            "amsgrad": draw(st.booleans()),
        }
    elif cls is SGDAccumulate:
        kwargs = {
            "learning_rate": draw(st.sampled_from([1e-2, 1e-1])),
            "momentum": draw(st.sampled_from([0.0, 0.5, 0.9])),
            "nesterov": draw(st.booleans()),
        }
    else:
        kwargs = {
            "learning_rate": draw(st.sampled_from([1e-3, 1e-2])),
            "rho": draw(st.sampled_from([0.8, 0.9])),
            "momentum": draw(st.sampled_from([0.0, 0.5])),
            "centered": draw(st.booleans()),
        }
    kwargs["weight_decay"] = draw(st.sampled_from([None, 0.01, 0.1]))
    clip = draw(
        st.sampled_from([None, "clipnorm", "clipvalue", "global_clipnorm"])
    )
    if clip is not None:
        kwargs[clip] = draw(st.sampled_from([0.05, 0.5]))
    return cls, kwargs


def assert_same_state(ours, parent_model, our_model, parent_optimizer):
    """Weights and every parent optimizer variable agree to f32 round-off.

    The two runs add the same float32 numbers in a different order (the
    big-batch gradient sums all samples at once; ours sums per micro-batch,
    then across micro-batches), so they differ by a few ulps per update.
    `rtol=1e-5, atol=1e-6` is about 100 ulps of float32 at the magnitudes
    used here (weights ~1, gradients ~1e-2..1), far below any real
    difference in the update rule (one update of lr >= 1e-3).
    """
    for expected, actual in zip(
        parent_model.get_weights(), our_model.get_weights()
    ):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    parent_state = parent_optimizer.variables
    our_state = ours.variables[: len(parent_state)]
    for expected, actual in zip(parent_state, our_state):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(actual.value),
            keras.ops.convert_to_numpy(expected.value),
            rtol=1e-5,
            atol=1e-7,
            err_msg=f"optimizer variable {expected.path} differs",
        )
