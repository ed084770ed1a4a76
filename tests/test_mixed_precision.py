"""Mixed precision: `mixed_float16` (Keras wraps the optimizer in a
`LossScaleOptimizer`), `mixed_bfloat16`, an explicit `LossScaleOptimizer`,
float32 accumulators, and micro-steps with non-finite gradients."""

import keras
import loops
import numpy as np
import pytest
from helpers import PARENTS
from helpers import assert_same_weights
from helpers import largest_difference
from helpers import regression_data
from helpers import small_model
from helpers import window_state
from keras import ops

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers._inner import accumulating_optimizers

K, B, WINDOWS = 4, 4, 3


def _fit(policy, optimizer, batch_size):
    keras.config.set_dtype_policy(policy)
    x, y = regression_data(11, WINDOWS * K * B)
    model = small_model(11)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    keras.config.set_dtype_policy("float32")
    return model


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("cls", list(PARENTS))
def test_mixed_precision_fit_matches_the_big_batch_run(policy, cls):
    start = small_model(11).get_weights()
    big = _fit(policy, PARENTS[cls](learning_rate=0.01), K * B)
    ours = _fit(policy, cls(learning_rate=0.01, accum_iters=K), B)
    if policy == "mixed_float16":
        assert isinstance(ours.optimizer, keras.optimizers.LossScaleOptimizer)
    assert [type(o) for o in accumulating_optimizers(ours.optimizer)] == [cls]
    assert int(ours.optimizer.iterations) == WINDOWS
    # Forward and backward run in 16-bit floats, whose rounding depends on
    # the batch they see (float16: 11-bit mantissa, ~5e-4 relative;
    # bfloat16: 8 bits, ~4e-3). The gradients of the big batch and of the
    # micro-batches therefore differ by a few 16-bit ulps, not f32 ulps.
    # We require the difference between the two runs to stay below 5% of
    # how far training moved the weights: a wrong update (a missed window,
    # a gradient k times too large) moves them by 100% or more.
    moved = largest_difference(big.get_weights(), start)
    difference = largest_difference(ours.get_weights(), big.get_weights())
    assert moved > 1e-3
    assert difference < 0.05 * moved, (difference, moved)


@pytest.mark.parametrize("cls", list(PARENTS))
def test_explicit_loss_scale_optimizer_fit_matches_the_big_batch_run(cls):
    big = _fit(
        "float32",
        keras.optimizers.LossScaleOptimizer(PARENTS[cls](learning_rate=0.01)),
        K * B,
    )
    ours = _fit(
        "float32",
        keras.optimizers.LossScaleOptimizer(
            cls(learning_rate=0.01, accum_iters=K)
        ),
        B,
    )
    assert int(ours.optimizer.iterations) == WINDOWS
    # float32 compute: the loss scale is a power of two, so scaling and
    # unscaling are exact and the usual float32 round-off bound holds.
    assert_same_weights(ours, big)


def test_accumulators_are_float32_for_float16_variables():
    variable = keras.Variable(np.ones(3), dtype="float16")
    optimizer = SGDAccumulate(accum_iters=2)
    optimizer.build([variable])
    assert window_state(optimizer)["sums"][0].dtype == "float32"
    chosen = SGDAccumulate(accum_iters=2, accumulator_dtype="float16")
    chosen.build([variable])
    assert window_state(chosen)["sums"][0].dtype == "float16"


def test_float16_variable_accumulates_tiny_gradients_in_float32():
    # 1e-4 is below half a float16 ulp of 1.0 (4.9e-4): a float16
    # accumulator starting near 1.0 would lose it; float32 keeps it.
    variable = keras.Variable(np.zeros(1), dtype="float16")
    optimizer = SGDAccumulate(learning_rate=1.0, accum_iters=4)
    for grad in [1.0, 1e-4, 1e-4, 1e-4]:
        optimizer.apply([ops.full((1,), grad, dtype="float16")], [variable])
    expected = -(1.0 + 3e-4) / 4
    np.testing.assert_allclose(
        ops.convert_to_numpy(variable.value), [expected], rtol=1e-3
    )


def test_non_finite_micro_step_is_dropped_without_poisoning_the_window():
    grads = [
        np.array([1.0, -2.0], "float32"),
        np.array([np.inf, 0.0], "float32"),  # dropped by the loss scaler
        np.array([3.0, 0.5], "float32"),
        np.array([-1.0, 4.0], "float32"),
        np.array([0.5, 0.5], "float32"),
    ]
    finite = [g for g in grads if np.all(np.isfinite(g))]

    reference = keras.Variable(np.zeros(2, "float32"))
    keras.optimizers.Adam(0.1).apply(
        [ops.convert_to_tensor(np.mean(finite, axis=0))], [reference]
    )

    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer = keras.optimizers.LossScaleOptimizer(
        AdamAccumulate(0.1, accum_iters=K)
    )
    optimizer.build([variable])
    for i, grad in enumerate(grads):
        # The loss scaler expects scaled gradients; its scale halves after
        # the non-finite step.
        scale = ops.convert_to_numpy(optimizer.dynamic_scale)
        loops.apply(
            optimizer, [ops.convert_to_tensor(grad * scale)], [variable]
        )
        inner = optimizer.inner_optimizer
        if i < len(grads) - 1:
            assert int(inner.iterations) == 0
            np.testing.assert_array_equal(
                ops.convert_to_numpy(variable.value), [0.0, 0.0]
            )
    assert int(inner.iterations) == 1
    assert int(inner.micro_batches_seen) == 4
    # rtol: on JAX our update runs compiled inside `lax.while_loop`, the
    # reference eagerly; XLA's fused float32 arithmetic differs by a few ulps.
    np.testing.assert_allclose(
        ops.convert_to_numpy(variable.value),
        ops.convert_to_numpy(reference.value),
        rtol=1e-5,
    )
