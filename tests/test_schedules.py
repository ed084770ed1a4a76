"""`accum_iters` as a schedule of applied updates: a batch-size ramp trains
exactly like the parent optimizer on growing big batches."""

import json

import keras
import numpy as np
import pytest
from helpers import assert_same_weights
from helpers import regression_data
from helpers import small_model

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers.schedules import LinearRamp

B = 2
RAMP = {0: 1, 2: 2, 4: 3}  # updates 0-1: k=1, 2-3: k=2, then k=3
SIZES = [1, 1, 2, 2, 3, 3]  # the window sizes of the first six updates


def _parent_on_growing_batches(x, y, sizes, seed=11):
    """The oracle: the parent Keras optimizer, one `train_on_batch` per
    update on the next `k(t) * B` samples."""
    model = small_model(seed)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01, amsgrad=True), loss="mse"
    )
    start = 0
    for size in sizes:
        stop = start + size * B
        model.train_on_batch(x[start:stop], y[start:stop])
        start = stop
    return model


def _ours(accum_iters, seed=11, **compile_options):
    model = small_model(seed)
    model.compile(
        optimizer=AdamAccumulate(0.01, amsgrad=True, accum_iters=accum_iters),
        loss="mse",
        **compile_options,
    )
    return model


MODES = {
    "tensorflow": [{}, {"jit_compile": True}, {"run_eagerly": True}],
    "jax": [{}, {"run_eagerly": True}],
    "torch": [{}],
}[keras.backend.backend()]


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_dict_ramp_equals_growing_big_batches(mode):
    x, y = regression_data(11, sum(SIZES) * B)
    parent = _parent_on_growing_batches(x, y, SIZES)
    ours = _ours(RAMP, **mode)
    ours.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(ours.optimizer.iterations) == len(SIZES)
    assert ours.optimizer.current_accum_iters == 3
    assert_same_weights(ours, parent)


def test_a_linear_ramp_equals_growing_big_batches():
    ramp = LinearRamp(1, 4, ramp_updates=3)
    sizes = [1, 2, 3, 4, 4]
    assert [int(ramp(t)) for t in range(5)] == sizes
    x, y = regression_data(12, sum(sizes) * B)
    parent = _parent_on_growing_batches(x, y, sizes)
    ours = _ours(ramp)
    ours.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_same_weights(ours, parent)


def test_a_model_saved_mid_ramp_and_mid_window_resumes_exactly(tmp_path):
    x, y = regression_data(13, sum(SIZES) * B)
    uninterrupted = _ours(RAMP)
    uninterrupted.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    interrupted = _ours(RAMP)
    first = (1 + 1 + 2 + 1) * B  # three updates, one micro-batch pending
    interrupted.fit(
        x[:first], y[:first], batch_size=B, shuffle=False, verbose=0
    )
    assert int(interrupted.optimizer.micro_steps) == 1
    path = tmp_path / "ramp.keras"
    interrupted.save(path)
    restored = keras.saving.load_model(path)
    assert restored.optimizer.accum_iters == RAMP
    assert int(restored.optimizer.micro_steps) == 1
    restored.fit(x[first:], y[first:], batch_size=B, shuffle=False, verbose=0)
    assert_same_weights(restored, uninterrupted, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "accum_iters", [RAMP, LinearRamp(2, 6, 10)], ids=["dict", "LinearRamp"]
)
def test_the_config_round_trips_through_json(accum_iters):
    optimizer = SGDAccumulate(0.1, accum_iters=accum_iters)
    text = json.dumps(keras.optimizers.serialize(optimizer))
    restored = keras.optimizers.deserialize(json.loads(text))
    assert type(restored) is SGDAccumulate
    assert restored.get_config() == optimizer.get_config()


@pytest.mark.parametrize(
    "bad",
    [{}, {1: 2}, {0: 0}, {0: 2.5}, {0: "a"}, {0: 2, -1: 1}, {0: 1, "x": 2}],
    ids=str,
)
def test_an_invalid_schedule_names_accum_iters(bad):
    with pytest.raises(ValueError, match="accum_iters"):
        SGDAccumulate(accum_iters=bad)


def test_a_pending_window_the_schedule_cannot_hold_is_refused():
    saved = SGDAccumulate(0.1, accum_iters=4)
    variables = [keras.Variable(np.ones(2, "float32"))]
    for _ in range(3):
        saved.apply([keras.ops.ones(2)], variables)
    store = {}
    saved.save_own_variables(store)
    ramp = SGDAccumulate(0.1, accum_iters={0: 2, 5: 8})  # k=2 at update 0
    ramp.build(variables)
    with pytest.raises(ValueError, match=r"3 micro-batches.*accum_iters=2"):
        ramp.load_own_variables(store)
