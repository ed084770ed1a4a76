"""`AccumBatchNormalization` against Keras' `BatchNormalization`.

The oracle is always a plain `BatchNormalization` layer (or model): called
once in training on the concatenated window for the moving statistics, on
the micro-batch for the training output.
"""

import warnings

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import assert_same_weights
from helpers import fit_in_order
from helpers import run_jax_worker
from helpers import run_mirrored_worker
from helpers import to_numpy
from hypothesis import given
from hypothesis import strategies as st

from accum_optimizers import AccumBatchNormalization
from accum_optimizers import AdamAccumulate
from accum_optimizers.layers import with_accum_batch_norm

MOVING = ["moving_mean", "moving_variance"]
RENORM_MOVING = MOVING + ["moving_stddev", "renorm_mean", "renorm_stddev"]
WINDOW = ["window_count", "window_mean", "window_m2", "window_calls"]


def _values(layer, names=MOVING):
    return {name: to_numpy(getattr(layer, name)) for name in names}


# Equal to float32 round-off of statistics of data up to ~30 in size
# (`_data`: mean 3, spread 2).
STATISTICS = {"rtol": 1e-5, "atol": 3e-5, "what": "statistic"}
# Unchanged.
UNCHANGED = {"rtol": 1e-5, "atol": 0.0, "what": "statistic"}


def _data(seed, sizes, inner_shape, offset=3.0, spread=2.0):
    """Micro-batches with a mean far from 0, where cancellation would show."""
    rng = np.random.default_rng(seed)
    return [
        (offset + spread * rng.normal(size=(n, *inner_shape))).astype("float32")
        for n in sizes
    ]


@st.composite
def windows(draw):
    """Draws layer options, shapes and uneven micro-batch sizes."""
    k = draw(st.integers(1, 4))
    rank = draw(st.integers(2, 4))
    # Few distinct shapes: eager JAX compiles every op once per shape.
    inner_shape = tuple(draw(st.sampled_from([1, 3])) for _ in range(rank - 1))
    axis = draw(st.sampled_from([-1, 1]))
    # Whole windows then a partial one, so the statistics must hold still.
    calls = k * draw(st.integers(1, 2)) + draw(st.integers(0, k - 1))
    sizes = [draw(st.sampled_from([1, 2, 5])) for _ in range(calls)]
    options = {
        "accum_iters": k,
        "axis": axis,
        "momentum": draw(st.sampled_from([0.0, 0.5, 0.9, 0.99])),
        "epsilon": draw(st.sampled_from([1e-3, 1e-5])),
    }
    return options, inner_shape, sizes, draw(st.integers(0, 2**16))


@given(windows())
def test_moving_statistics_equal_a_batch_norm_on_the_window_batch(drawn):
    options, inner_shape, sizes, seed = drawn
    k = options["accum_iters"]
    parent_options = {n: v for n, v in options.items() if n != "accum_iters"}
    micro_batches = _data(seed, sizes, inner_shape)
    ours = AccumBatchNormalization(**options)
    big = keras.layers.BatchNormalization(**parent_options)
    per_call = keras.layers.BatchNormalization(**parent_options)
    for layer in (ours, big, per_call):
        layer.build((None, *inner_shape))

    for i, x in enumerate(micro_batches):
        before = _values(ours)
        output = ours(x, training=True)
        # Training output: normalized with the micro-batch's own statistics.
        np.testing.assert_allclose(
            to_numpy(output),
            to_numpy(per_call(x, training=True)),
            rtol=1e-5,
            atol=1e-5,
        )
        if (i + 1) % k:
            for name, value in _values(ours).items():
                np.testing.assert_array_equal(value, before[name], name)
            continue
        window = np.concatenate(micro_batches[i + 1 - k : i + 1])
        big(window, training=True)
        if k == 1:  # exactly BatchNormalization
            for name, value in _values(big).items():
                np.testing.assert_array_equal(_values(ours)[name], value)
        assert_all_close(_values(ours), _values(big), **STATISTICS)
        assert int(to_numpy(ours.window_calls)) == 0


def test_renorm_statistics_move_once_per_window_with_window_statistics():
    k, sizes = 3, [4, 1, 6, 2, 5, 3]
    options = {"momentum": 0.8, "renorm": True, "renorm_momentum": 0.7}
    micro_batches = _data(1, sizes, (3,))
    ours = AccumBatchNormalization(accum_iters=k, **options)
    big = keras.layers.BatchNormalization(**options)
    for layer in (ours, big):
        layer.build((None, 3))
    for start in range(0, len(sizes), k):
        for x in micro_batches[start : start + k - 1]:
            before = _values(ours, RENORM_MOVING)
            ours(x, training=True)
            assert_all_close(_values(ours, RENORM_MOVING), before, **UNCHANGED)
        ours(micro_batches[start + k - 1], training=True)
        big(np.concatenate(micro_batches[start : start + k]), training=True)
        assert_all_close(
            _values(ours, RENORM_MOVING),
            _values(big, RENORM_MOVING),
            **STATISTICS,
        )


def test_masked_positions_count_for_neither_call_nor_window():
    k, sizes, steps = 2, [3, 5, 2, 4], 6
    rng = np.random.default_rng(2)
    micro_batches = _data(3, sizes, (steps, 2))
    masks = [rng.random((n, steps)) < 0.6 for n in sizes]
    masks[2][:] = False  # a micro-batch with no valid position at all
    ours = AccumBatchNormalization(accum_iters=k, momentum=0.6)
    big = keras.layers.BatchNormalization(momentum=0.6)
    per_call = keras.layers.BatchNormalization(momentum=0.6)
    for start in range(0, len(sizes), k):
        for x, mask in zip(
            micro_batches[start : start + k], masks[start : start + k]
        ):
            np.testing.assert_allclose(
                to_numpy(ours(x, training=True, mask=mask)),
                to_numpy(per_call(x, training=True, mask=mask)),
                rtol=1e-5,
                atol=1e-5,
            )
        big(
            np.concatenate(micro_batches[start : start + k]),
            training=True,
            mask=np.concatenate(masks[start : start + k]),
        )
        assert_all_close(_values(ours), _values(big), **STATISTICS)


def test_flush_moves_statistics_with_the_partial_window():
    sizes = [3, 5, 2, 4, 6]  # a window of 3, then 2 calls pending
    micro_batches = _data(14, sizes, (2,))
    ours = AccumBatchNormalization(accum_iters=3, momentum=0.5)
    big = keras.layers.BatchNormalization(momentum=0.5)
    ours.flush()  # unbuilt: nothing to do
    for x in micro_batches:
        ours(x, training=True)
    big(np.concatenate(micro_batches[:3]), training=True)
    big(np.concatenate(micro_batches[3:]), training=True)

    ours.flush()
    assert_all_close(_values(ours), _values(big), **STATISTICS)
    assert int(to_numpy(ours.window_calls)) == 0
    flushed = _values(ours)
    ours.flush()  # empty window: nothing moves
    assert_all_close(_values(ours), flushed, **UNCHANGED)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_statistics_stay_float32_and_exact(policy):
    keras.config.set_dtype_policy(policy)
    micro_batches = _data(15, [4, 3], (2, 3), offset=1.0)
    ours = AccumBatchNormalization(accum_iters=2)
    big = keras.layers.BatchNormalization()
    for x in micro_batches:
        ours(x, training=True)
    big(np.concatenate(micro_batches), training=True)
    assert ours.window_mean.dtype == "float32"
    # Both see the same 16-bit inputs, upcast to float32.
    assert_all_close(_values(ours), _values(big), **STATISTICS)


def _input_bn_model(layer, seed=0, features=3):
    # Batch normalization first: its inputs are the data, whatever the
    # weights behind it learn, so both runs feed it the same samples.
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((features,)),
            layer,
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _fit_modes():
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return {
            "graph": {"jit_compile": False},
            "xla": {"jit_compile": True},
            "eager": {"run_eagerly": True},
        }
    if backend == "jax":
        # Eager JAX runs op by op and is slow; jit is what fit runs.
        return {"jit": {"jit_compile": True}}
    return {"eager": {}}


@pytest.mark.parametrize("mode", sorted(_fit_modes()))
def test_fit_with_accumulation_moves_statistics_like_the_big_batch(mode):
    k, b, n = 3, 4, 35  # the last window holds micro-batches of 4, 4, 3
    x = _data(4, [n], (3,))[0]
    y = np.random.default_rng(5).normal(size=(n, 1)).astype("float32")
    options = {"momentum": 0.7}

    ours = _input_bn_model(AccumBatchNormalization(accum_iters=k, **options))
    ours.compile(
        optimizer=AdamAccumulate(accum_iters=k),
        loss="mse",
        **_fit_modes()[mode],
    )
    fit_in_order(ours, x, y, batch_size=b, epochs=2)
    parent = _input_bn_model(keras.layers.BatchNormalization(**options))
    parent.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    fit_in_order(parent, x, y, batch_size=k * b, epochs=2)

    assert int(ours.optimizer.iterations) == int(parent.optimizer.iterations)
    assert_all_close(
        _values(ours.layers[0]), _values(parent.layers[0]), **STATISTICS
    )
    assert int(to_numpy(ours.layers[0].window_calls)) == 0


def test_flush_accumulation_flushes_the_layers_with_the_optimizer():
    k, b, n = 3, 4, 32  # each epoch ends with 2 micro-batches pending
    x = _data(6, [n], (3,))[0]
    y = np.random.default_rng(6).normal(size=(n, 1)).astype("float32")
    ours = _input_bn_model(AccumBatchNormalization(accum_iters=k))
    ours.compile(optimizer=AdamAccumulate(accum_iters=k), loss="mse")
    fit_in_order(ours, x, y, batch_size=b, epochs=2, flush=True)
    parent = _input_bn_model(keras.layers.BatchNormalization())
    parent.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    fit_in_order(parent, x, y, batch_size=k * b, epochs=2)
    assert int(to_numpy(ours.layers[0].window_calls)) == 0
    assert_all_close(
        _values(ours.layers[0]), _values(parent.layers[0]), **STATISTICS
    )


@pytest.mark.parametrize(
    "accum_iters, warns",
    [(3, True), ({0: 2, 4: 3}, True), (2, False), ({0: 2}, False)],
)
def test_fit_warns_when_the_optimizer_has_other_windows(accum_iters, warns):
    model = _input_bn_model(AccumBatchNormalization(accum_iters=2))
    optimizer = AdamAccumulate(accum_iters=accum_iters)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
    x = _data(7, [4], (3,))[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, x[:, :1], batch_size=2, verbose=0)
    named = [
        str(w.message)
        for w in caught
        if "AccumBatchNormalization" in str(w.message)
    ]
    if not warns:
        assert named == []
        return
    (message,) = named
    assert "has accum_iters=2, but optimizer" in message
    assert f"has accum_iters={accum_iters!r}:" in message


def _fit_accumulating(model, x, y, b):
    fit_in_order(model, x, y, batch_size=b)


def test_keras_file_saved_mid_window_resumes_exactly(tmp_path):
    k, b = 3, 4
    x = _data(6, [7 * b], (3,))[0]
    y = np.random.default_rng(7).normal(size=(7 * b, 1)).astype("float32")
    first, rest = slice(0, 5 * b), slice(5 * b, None)  # 2 of 3 pending

    def compiled():
        model = _input_bn_model(AccumBatchNormalization(accum_iters=k))
        model.compile(optimizer=AdamAccumulate(accum_iters=k), loss="mse")
        return model

    uninterrupted = compiled()
    _fit_accumulating(uninterrupted, x, y, b)
    interrupted = compiled()
    _fit_accumulating(interrupted, x[first], y[first], b)
    assert int(to_numpy(interrupted.layers[0].window_calls)) == 2
    path = tmp_path / "mid_window.keras"
    interrupted.save(path)
    objects = {
        "AccumBatchNormalization": AccumBatchNormalization,
        "AdamAccumulate": AdamAccumulate,
    }
    for custom_objects in (objects, None):  # None: found as registered
        restored = keras.saving.load_model(path, custom_objects=custom_objects)
        assert type(restored.layers[0]) is AccumBatchNormalization
        assert restored.layers[0].accum_iters == k
        assert_all_close(
            _values(restored.layers[0], MOVING + WINDOW),
            _values(interrupted.layers[0], MOVING + WINDOW),
            **UNCHANGED,
        )
    _fit_accumulating(restored, x[rest], y[rest], b)

    assert_all_close(
        _values(restored.layers[0], MOVING + WINDOW),
        _values(uninterrupted.layers[0], MOVING + WINDOW),
        rtol=1e-6,
        atol=1e-6,
        what="statistic",
    )
    assert_same_weights(restored, uninterrupted, rtol=1e-6, atol=1e-6)


def test_weights_file_holds_the_pending_window(tmp_path):
    layer = AccumBatchNormalization(accum_iters=4)
    model = keras.Sequential([keras.Input((3,)), layer])
    for x in _data(8, [5, 2], (3,)):
        model(x, training=True)
    path = tmp_path / "mid_window.weights.h5"
    model.save_weights(path)
    fresh = keras.Sequential(
        [keras.Input((3,)), AccumBatchNormalization(accum_iters=4)]
    )
    fresh.load_weights(path)
    saved = _values(layer, MOVING + WINDOW)
    assert saved["window_calls"] == 2
    assert_all_close(
        _values(fresh.layers[0], MOVING + WINDOW), saved, **UNCHANGED
    )


@pytest.mark.parametrize(
    "bad, error",
    [
        (0, ValueError),
        (-2, ValueError),
        (2**31, ValueError),
        (2.5, TypeError),
        ("3", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_bad_accum_iters_is_refused_naming_the_value(bad, error):
    with pytest.raises(error, match=rf"accum_iters={bad!r}"):
        AccumBatchNormalization(accum_iters=bad)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(error, match=rf"accum_iters={bad!r}"):
        with_accum_batch_norm(model, accum_iters=bad)


def test_config_round_trips_accum_iters_and_parent_options():
    layer = AccumBatchNormalization(
        accum_iters=5, axis=1, momentum=0.5, epsilon=1e-4, center=False
    )
    config = keras.saving.serialize_keras_object(layer)
    assert config["registered_name"] == (
        "accum_optimizers>AccumBatchNormalization"
    )
    restored = keras.saving.deserialize_keras_object(config)
    assert type(restored) is AccumBatchNormalization
    assert restored.get_config() == layer.get_config()
    assert restored.accum_iters == 5


def _randomized(layer, seed):
    rng = np.random.default_rng(seed)
    for variable in layer.weights:
        if variable.name in MOVING + ["gamma", "beta"]:
            value = rng.uniform(0.5, 2.0, size=variable.shape)
            variable.assign(value.astype("float32"))


def test_inference_is_batch_normalization_with_the_same_weights():
    x = _data(9, [6], (2, 3))[0]
    ours = AccumBatchNormalization(accum_iters=3, epsilon=1e-2)
    parent = keras.layers.BatchNormalization(epsilon=1e-2)
    for layer in (ours, parent):
        layer.build(x.shape)
    _randomized(parent, 10)
    for name in MOVING + ["gamma", "beta"]:
        getattr(ours, name).assign(getattr(parent, name))
    np.testing.assert_array_equal(
        to_numpy(ours(x, training=False)), to_numpy(parent(x, training=False))
    )
    # A frozen layer runs in inference mode and keeps its window empty.
    ours.trainable = False
    np.testing.assert_array_equal(
        to_numpy(ours(x, training=True)), to_numpy(parent(x, training=False))
    )
    assert float(to_numpy(ours.window_count).sum()) == 0.0


def test_swap_helper_keeps_weights_and_predictions():
    keras.utils.set_random_seed(11)
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
        ]
    )
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization(momentum=0.5)(inner(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    for layer in (model.layers[2], inner.layers[1]):
        _randomized(layer, 12)
    x = _data(13, [5], (4,))[0]

    swapped = with_accum_batch_norm(model, accum_iters=3)

    swapped_norms = [
        layer
        for layer in swapped._flatten_layers()
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    assert len(swapped_norms) == 2
    assert all(
        type(layer) is AccumBatchNormalization and layer.accum_iters == 3
        for layer in swapped_norms
    )
    assert swapped.layers[2].momentum == 0.5
    np.testing.assert_array_equal(
        to_numpy(swapped(x, training=False)), to_numpy(model(x, training=False))
    )
    np.testing.assert_allclose(
        to_numpy(swapped(x, training=True)),
        to_numpy(model(x, training=True)),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.backends("tensorflow")
def test_mirrored_strategy_synchronized_is_the_global_window(tmp_path):
    results = run_mirrored_worker(
        "batchnorm_mirrored_worker.py", tmp_path / "results.json"
    )
    # synchronized=True: the one-device big batch, with a short micro-batch
    # split 3 / 2 between the replicas.
    assert results["synchronized"] < 1e-5
    # synchronized=False: each replica pools its own shards of the window.
    assert results["unsynchronized"] < 1e-5


@pytest.mark.backends("jax")
def test_jax_data_parallel_is_the_global_window(tmp_path):
    results = run_jax_worker(
        "batchnorm_dataparallel_worker.py",
        tmp_path / "results.json",
        2,
        timeout=600,
    )
    assert results["devices"] == 2
    assert results["difference"] < 1e-5


def test_swap_helper_refuses_other_batch_norm_subclasses():
    class CustomNorm(keras.layers.BatchNormalization):
        pass

    model = keras.Sequential([keras.Input((2,)), CustomNorm(name="custom")])
    with pytest.raises(ValueError, match="'custom' of class CustomNorm"):
        with_accum_batch_norm(model, accum_iters=2)
