"""The window's state: its total weight, the weights it refuses, and the
states it restores.

Oracles: the parent Keras optimizer applying the window's weighted mean
gradient computed in float64 numpy; the parent fitted on the big batch;
Keras' own state layout.
"""

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import parent_on_window_means
from helpers import random_variables
from helpers import regression_data
from helpers import sample_weights
from helpers import small_model
from helpers import to_numpy
from helpers import window_state
from modes import MODES
from modes import applier

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import weigh_micro_batches

BACKEND = keras.backend.backend()
SHAPES = ((3, 2), (2,))


def _variables(seed=0):
    return random_variables(seed, SHAPES)


def _gradients(seed, count):
    rng = np.random.default_rng(seed)
    return [
        [rng.normal(size=s).astype("float32") for s in SHAPES]
        for _ in range(count)
    ]


def _tensors(arrays):
    return [keras.ops.convert_to_tensor(a) for a in arrays]


def _state(optimizer):
    return to_numpy(optimizer.variables)


# -- The total weight is a sum of weights ------------------------------------


@pytest.mark.parametrize(
    "weights",
    [
        (1e-6, 1e-6, 2e-6),
        (1e-8, 3e-8, 1e-8),
        (1e-30, 1e-30, 5e-31),
        (1e30, 2e30, 1e30),
        (1e-6, 1.0, 1e6),
    ],
    ids=["1e-6", "1e-8", "1e-30", "1e30", "mixed"],
)
@pytest.mark.parametrize("mode", MODES)
def test_tiny_and_huge_weights_give_the_big_batch_mean(mode, weights):
    grads = _gradients(1, len(weights))
    ours_variables = _variables()
    ours = SGDAccumulate(0.5, accum_iters=len(weights))
    step = applier(ours, ours_variables, mode)
    for grad, weight in zip(grads, weights):
        step(_tensors(grad), weight=weight)
    parent_variables = _variables()
    parent_on_window_means(
        keras.optimizers.SGD(0.5), parent_variables, [grads], [weights]
    )
    assert_all_close(ours_variables, parent_variables, rtol=1e-5, atol=1e-6)
    # Not vacuous: the update moved the weights by about the learning rate.
    moved = to_numpy(ours_variables)[0] - to_numpy(_variables())[0]
    assert np.abs(moved).max() > 0.1


@pytest.mark.parametrize("weight", [1e-50, 1e-40, 0.0, -1e-6, 1e39])
def test_weights_float32_cannot_hold_are_refused_and_change_nothing(weight):
    variables = _variables()
    optimizer = AdamAccumulate(0.1, accum_iters=3)
    optimizer.build(variables)
    optimizer.apply(_tensors(_gradients(2, 1)[0]), variables, weight=2.0)
    before = _state(optimizer)
    with pytest.raises(ValueError, match=r"weight=.*"):
        optimizer.apply(_tensors(_gradients(3, 1)[0]), variables, weight=weight)
    assert_all_close(optimizer.variables, before, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [1e-6, 1e-8])
def test_fit_with_tiny_sample_weights_equals_the_big_batch(scale):
    k, b = 3, 4
    x, y = regression_data(0, k * b * 2)
    weights = sample_weights(1, len(x)) * scale
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    parent = small_model(0)
    parent.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    parent.fit(
        x, y, sample_weight=weights, batch_size=k * b, shuffle=False, verbose=0
    )
    ours = small_model(0)
    ours.compile(optimizer=SGDAccumulate(0.5, accum_iters=k), loss=loss)
    weigh_micro_batches(ours)
    ours.fit(
        x, y, sample_weight=weights, batch_size=b, shuffle=False, verbose=0
    )
    assert_all_close(ours.weights, parent.weights, rtol=1e-5, atol=1e-6)
    moved = to_numpy(ours.weights)[0] - to_numpy(small_model(0).weights)[0]
    assert np.abs(moved).max() > 1e-2


# -- Low-precision sums ------------------------------------------------------


@pytest.mark.parametrize("weighing", ["weight", "fit"])
def test_float16_sums_refuse_weights_and_change_nothing(weighing):
    optimizer = SGDAccumulate(0.1, accum_iters=3, accumulator_dtype="float16")
    if weighing == "weight":
        variables = _variables()
        optimizer.build(variables)
        optimizer.apply(_tensors(_gradients(2, 1)[0]), variables)
        before = _state(optimizer)
        with pytest.raises(ValueError, match="accumulator_dtype='float16'"):
            optimizer.apply(
                _tensors(_gradients(3, 1)[0]), variables, weight=70000.0
            )
        assert_all_close(optimizer.variables, before, rtol=0, atol=0)
        return
    x, y = regression_data(0, 8)
    model = small_model(0)
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match="accumulator_dtype='float16'"):
        weigh_micro_batches(model)
    # Weighed before `compile`: the first micro-batch raises.
    model = weigh_micro_batches(small_model(0))
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match="accumulator_dtype='float16'"):
        model.fit(x, y, batch_size=4, verbose=0)
    if BACKEND != "jax":  # Keras' JAX `fit` leaves no state after an error
        assert int(optimizer.micro_steps) == 0
        assert int(optimizer.iterations) == 0


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_sums_weigh_a_token_count_without_overflow(mode):
    weights = (70000.0, 4096.0, 65000.0)
    grads = _gradients(4, len(weights))
    variables = _variables()
    optimizer = SGDAccumulate(
        0.5, accum_iters=len(weights), accumulator_dtype="bfloat16"
    )
    step = applier(optimizer, variables, mode)
    for grad, weight in zip(grads, weights):
        step(_tensors([20 * g for g in grad]), weight=weight)
    expected = _variables()
    parent_on_window_means(
        keras.optimizers.SGD(0.5),
        expected,
        [[[20 * g for g in grad] for grad in grads]],
        [weights],
    )
    result = to_numpy(variables)
    assert all(np.isfinite(r).all() for r in result)
    # bfloat16 holds 8 significant bits: a relative error of 2**-8 per sum.
    assert_all_close(variables, expected, rtol=2e-2, atol=0.5)


# -- Restoring ---------------------------------------------------------------


def _trained_plain_state(optimizer, steps):
    variables = _variables()
    optimizer.build(variables)
    for grad in _gradients(5, steps):
        optimizer.apply(_tensors(grad), variables)
    store = {}
    optimizer.save_own_variables(store)
    return store


@pytest.mark.parametrize(
    "make_target",
    [
        lambda: SGDAccumulate(0.1, momentum=0.9, accum_iters=2),
        lambda: AdamAccumulate(0.1, accum_iters=4),
    ],
    ids=["SGD-momentum", "Adam"],
)
@pytest.mark.parametrize("built", [True, False], ids=["built", "unbuilt"])
@pytest.mark.parametrize("steps", [4, 8])
def test_a_trained_state_without_moments_is_refused(make_target, built, steps):
    store = _trained_plain_state(keras.optimizers.SGD(0.1), steps)
    target = make_target()
    variables = _variables()
    if built:
        target.build(variables)
        before = _state(target)
        with pytest.raises(ValueError, match=f"iterations={steps}"):
            target.load_own_variables(store)
        assert_all_close(target.variables, before, rtol=0, atol=0)
    else:
        target.load_own_variables(store)  # kept until `build`
        with pytest.raises(ValueError, match=f"iterations={steps}"):
            target.build(variables)


def test_a_state_saved_before_training_still_loads_into_a_built_optimizer():
    store = {}
    SGDAccumulate(0.1, momentum=0.9, accum_iters=2).save_own_variables(store)
    target = SGDAccumulate(0.1, momentum=0.9, accum_iters=2)
    variables = _variables()
    target.build(variables)
    target.load_own_variables(store)
    assert int(target.iterations) == 0


def test_a_state_between_windows_empties_a_pending_window():
    # Saved between windows, whatever its sums hold (the last window's
    # values, garbage here): the restored optimizer starts a fresh window,
    # also where it was mid-window, and its next window is exact.
    variables = _variables()
    saved = AdamAccumulate(0.1, accum_iters=2)
    saved.build(variables)
    for grad in _gradients(6, 2):
        saved.apply(_tensors(grad), variables)
    store = {}
    saved.save_own_variables(store)
    sums = {id(v) for v in window_state(saved)["sums"]}
    for i, variable in enumerate(saved.variables):
        if id(variable) in sums:
            store[str(i)] = np.full(variable.shape, 1e3, "float32")
    target_variables = [keras.Variable(v.numpy()) for v in variables]
    target = AdamAccumulate(0.1, accum_iters=2)
    target.build(target_variables)
    target.apply(_tensors(_gradients(7, 1)[0]), target_variables)  # mid-window
    target.load_own_variables(store)
    assert int(target.micro_steps) == 0
    assert int(target.micro_batches_seen) == 2
    window = _gradients(8, 2)
    for grad in window:
        target.apply(_tensors(grad), target_variables)
        saved.apply(_tensors(grad), variables)
    parent_variables = _variables()
    parent_on_window_means(
        keras.optimizers.Adam(0.1), parent_variables, [_gradients(6, 2), window]
    )
    assert_all_close(target_variables, parent_variables, rtol=1e-5, atol=1e-6)
    assert_all_close(variables, parent_variables, rtol=1e-5, atol=1e-6)
