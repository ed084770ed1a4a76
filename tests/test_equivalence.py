"""Accumulating k micro-batches of size b equals one batch of size k*b.

The oracle is always the parent Keras optimizer on the concatenated batch,
with the same drawn options: every optimizer flag, clipping, weight decay,
learning-rate schedules and EMA together.
"""

import keras
import numpy as np
from helpers import PARENTS
from helpers import assert_all_close
from helpers import assert_same_state
from helpers import optimizer_configs
from helpers import parent_on_window_means
from helpers import regression_data
from helpers import small_model
from helpers import to_numpy
from helpers import window_state
from hypothesis import given
from hypothesis import strategies as st
from loops import gradients
from loops import train_in_batches

from accum_optimizers import SGDAccumulate

# Every optimizer flag, k = 1..6 micro-batches of 1..8 samples, 2..4 windows.
WINDOW_DRAWS = dict(
    config=optimizer_configs(),
    accum_iters=st.integers(1, 6),
    micro_batch=st.integers(1, 8),
    windows=st.integers(2, 4),
    seed=st.integers(0, 2**16),
)


@given(**WINDOW_DRAWS)
def test_fit_equals_parent_on_concatenated_batch(
    config, accum_iters, micro_batch, windows, seed
):
    cls, kwargs = config
    x, y = regression_data(seed, windows * accum_iters * micro_batch)

    parent_model = small_model(seed)
    parent = PARENTS[cls](**kwargs)
    parent_model.compile(optimizer=parent, loss="mse")
    parent_model.fit(
        x, y, batch_size=accum_iters * micro_batch, shuffle=False, verbose=0
    )

    our_model = small_model(seed)
    ours = cls(accum_iters=accum_iters, **kwargs)
    our_model.compile(optimizer=ours, loss="mse")
    our_model.fit(x, y, batch_size=micro_batch, shuffle=False, verbose=0)

    assert int(ours.iterations) == windows
    assert_same_state(ours, parent_model, our_model, parent)


@given(**WINDOW_DRAWS)
def test_custom_loop_equals_parent_and_holds_still_inside_window(
    config, accum_iters, micro_batch, windows, seed
):
    cls, kwargs = config
    k, b = accum_iters, micro_batch
    x, y = regression_data(seed, windows * k * b)
    parent_model, our_model = small_model(seed), small_model(seed)
    parent, ours = PARENTS[cls](**kwargs), cls(accum_iters=k, **kwargs)
    parent.build(parent_model.trainable_variables)
    ours.build(our_model.trainable_variables)
    parent_state_size = len(parent.variables)

    train_in_batches(parent, parent_model, x, y, k * b)
    for window in range(windows):
        for micro in range(k):
            start = window * k * b + micro * b
            small = slice(start, start + b)
            before = to_numpy(
                our_model.trainable_variables
                + ours.variables[:parent_state_size]
            )
            ours.apply(
                gradients(our_model, x[small], y[small]),
                our_model.trainable_variables,
            )
            if micro < k - 1:
                after = to_numpy(
                    our_model.trainable_variables
                    + ours.variables[:parent_state_size]
                )
                for held, now in zip(before, after):
                    np.testing.assert_array_equal(now, held)
        assert int(ours.iterations) == window + 1

    assert_same_state(ours, parent_model, our_model, parent)


def test_accumulators_hold_the_running_sum_and_restart_after_update():
    """Within a window the accumulators hold the running sum of the
    gradients; after the update the next window starts from zero
    (TensorFlow and JAX overwrite instead of zeroing, so the restart is
    checked by the first micro-step of the next window, also in an
    optimizer restored from what is saved in between)."""
    model = small_model(0)
    x, y = regression_data(0, 6)
    optimizer = SGDAccumulate(accum_iters=3)

    def assert_accumulators(expected):
        assert_all_close(
            window_state(optimizer)["sums"],
            expected,
            rtol=1e-6,
            atol=0,
            what="sum",
        )

    expected = [np.zeros(v.shape, "float32") for v in model.trainable_variables]
    for i in range(3):
        grads = gradients(model, x[i : i + 1], y[i : i + 1])
        optimizer.apply(grads, model.trainable_variables)
        expected = [e + g for e, g in zip(expected, to_numpy(grads))]
        if i < 2:
            assert_accumulators(expected)
    assert int(optimizer.micro_steps) == 0
    store = {}
    optimizer.save_own_variables(store)
    restored = SGDAccumulate(accum_iters=3)
    restored.build(model.trainable_variables)
    restored.load_own_variables(store)
    grads = gradients(model, x[3:4], y[3:4])
    for each in (optimizer, restored):
        each.apply(grads, model.trainable_variables)
        assert_all_close(
            window_state(each)["sums"],
            to_numpy(grads),
            rtol=1e-6,
            atol=0,
            what="sum",
        )


def test_a_missing_gradient_adds_zero_and_starts_no_stale_window():
    """A `None` gradient counts as zero in its window: oracle, the parent
    on the window's mean with zeros in place of the missing gradients."""
    rng = np.random.default_rng(0)
    grads_a = [rng.normal(size=3).astype("float32") for _ in range(4)]
    grads_b = [rng.normal(size=2).astype("float32") for _ in range(4)]
    grads_b[2] = None  # b has no gradient on the first step of window 2

    ours_vars = [keras.Variable(np.ones(3)), keras.Variable(np.ones(2))]
    ours = SGDAccumulate(learning_rate=0.1, accum_iters=2)
    tensor = keras.ops.convert_to_tensor
    for a, b in zip(grads_a, grads_b):
        ours.apply([tensor(a), None if b is None else tensor(b)], ours_vars)

    parent_vars = [keras.Variable(np.ones(3)), keras.Variable(np.ones(2))]
    steps = list(zip(grads_a, grads_b))
    parent_on_window_means(
        keras.optimizers.SGD(learning_rate=0.1),
        parent_vars,
        [steps[0:2], steps[2:4]],
    )
    assert_all_close(ours_vars, parent_vars, rtol=1e-6, atol=0)
