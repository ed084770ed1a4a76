"""Features combined (a MultiOptimizer with weighted windows, BatchNorm
inside custom layers, sample weights with masks, mixed precision with a
weights-only resume, validation and checkpoints around a flush, the logger
with schedules): each case ends exact, or with an error that names the
problem.

Oracles: the parent Keras optimizer (or `BatchNormalization`) trained on the
concatenated big batch, the uninterrupted run, Keras' own `evaluate`."""

import re
import warnings

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import regression_data
from helpers import sequence_data
from helpers import sequence_model
from helpers import small_model

from accum_optimizers import AccumBatchNormalization
from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import weigh_micro_batches
from accum_optimizers.layers import with_accum_batch_norm
from accum_optimizers.schedules import AccumSchedule
from accum_optimizers.schedules import LinearRamp

BACKEND = keras.backend.backend()


def _assert_close(actual, expected, rtol=1e-5, atol=2e-6):
    assert_all_close(actual, expected, rtol=rtol, atol=atol)


def _fit(model, x, y, batch_size, epochs=2, callbacks=(), **kwargs):
    return model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
        **kwargs,
    )


# 2. MultiOptimizer -----------------------------------------------------------


def _multi(default, other, mapped_by="map"):
    """A `MultiOptimizer` of `other` for the biases, `default` for the
    rest, named by an `OptimizerMap`, or by a function (which names its
    optimizers only once built)."""
    if mapped_by == "function":
        return keras.optimizers.MultiOptimizer(
            lambda v: other if v.path.endswith("/bias") else default
        )
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(default, {".*/bias": other})
    )


def _multi_pair(
    k=3, b=4, n=11, callbacks=(), weigh=True, mapped_by="map", eagerly=False
):
    """Windows of 4, 4, 3 samples: ours under a MultiOptimizer (compiled
    with `run_eagerly=eagerly`), and the parents' MultiOptimizer on the
    big batch."""
    x, y = regression_data(5, n)
    parent = small_model(5)
    parent.compile(
        optimizer=_multi(
            keras.optimizers.SGD(0.1, momentum=0.9), keras.optimizers.Adam(0.05)
        ),
        loss="mse",
    )
    _fit(parent, x, y, k * b)
    ours = small_model(5)
    ours.compile(
        optimizer=_multi(
            SGDAccumulate(0.1, momentum=0.9, accum_iters=k),
            AdamAccumulate(0.05, accum_iters=k),
            mapped_by,
        ),
        loss="mse",
        run_eagerly=eagerly,
    )
    if weigh:
        weigh_micro_batches(ours)
    history = _fit(ours, x, y, b, callbacks=callbacks)
    return ours, parent, history


def test_multi_optimizer_weighs_uneven_micro_batches_like_the_big_batch():
    ours, parent, _ = _multi_pair(callbacks=[FlushAccumulation()])
    _assert_close(ours.get_weights(), parent.get_weights())


class _WindowLosses(keras.callbacks.Callback):
    """Each epoch's last window loss of a `MultiOptimizer`'s optimizers
    (read without building it)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        optimizers = self.model.optimizer.optimizers
        self.losses.append([float(o.window_loss) for o in optimizers])


@pytest.mark.parametrize("weigh, n, seen", [(True, 11, 22), (False, 12, 6)])
def test_multi_optimizer_mapped_by_a_function_takes_the_first_step_eagerly(
    weigh, n, seen
):
    # Unbuilt, it names its optimizers in the first step's `apply`, after
    # that micro-batch's weight and loss were handed over (no callback
    # builds it before here).
    window_losses = _WindowLosses()
    ours, parent, history = _multi_pair(
        n=n,
        weigh=weigh,
        mapped_by="function",
        eagerly=True,
        callbacks=[window_losses],
    )
    _assert_close(ours.get_weights(), parent.get_weights())
    optimizers = ours.optimizer.optimizers
    # Samples when weighted, else micro-batches, over two epochs.
    assert [float(o.samples_seen) for o in optimizers] == [seen] * 2
    # One window an epoch: its loss is the epoch's, as Keras' tracker
    # averages the micro-batches' over their samples.
    expected = [[loss] * 2 for loss in history.history["loss"]]
    np.testing.assert_allclose(window_losses.losses, expected, rtol=1e-6)


def test_multi_optimizer_unweighted_short_window_differs():
    # Not vacuous: without the weights the short micro-batch counts fully.
    ours, parent, _ = _multi_pair(weigh=False, callbacks=[FlushAccumulation()])
    gap = max(
        np.abs(o - p).max()
        for o, p in zip(ours.get_weights(), parent.get_weights())
    )
    assert gap > 1e-4


@pytest.mark.parametrize("mapped_by", ["map", "function"])
def test_multi_optimizer_iterations_count_updates_and_logger_reads_them(
    mapped_by,
):
    # A function names the optimizers only once built: TensorFlow builds
    # in the first traced step, after the callbacks' `on_train_begin`.
    ours, parent, history = _multi_pair(
        callbacks=[FlushAccumulation(), AccumulationLogger()],
        mapped_by=mapped_by,
    )
    _assert_close(ours.get_weights(), parent.get_weights())
    # Two epochs of one window of 4, 4, 3 samples each.
    for inner in ours.optimizer.optimizers:
        assert int(inner.iterations) == 2
    assert int(ours.optimizer.iterations) == 2
    assert int(parent.optimizer.iterations) == 2
    assert history.history["updates"] == [1, 2]


class _Threes(AccumSchedule):
    """A user's schedule that gives no config."""

    def __call__(self, update):
        return 3


@pytest.mark.parametrize(
    "accum_iters, shown", [(3, "3"), (_Threes(), "_Threes(...)")]
)
def test_logger_refuses_a_multi_optimizer_of_different_windows(
    accum_iters, shown
):
    x, y = regression_data(5, 8)
    model = small_model(5)
    model.compile(
        optimizer=_multi(
            SGDAccumulate(0.1, accum_iters=2),
            AdamAccumulate(accum_iters=accum_iters),
        ),
        loss="mse",
    )
    expected = re.escape(f"accum_iters=[{shown}, 2]")
    with pytest.raises(ValueError, match=expected):
        _fit(model, x, y, 2, callbacks=[AccumulationLogger()])


def test_flush_refuses_a_multi_optimizer_without_accumulation_naming_it():
    x, y = regression_data(5, 8)
    model = small_model(5)
    model.compile(
        optimizer=_multi(keras.optimizers.SGD(), keras.optimizers.Adam()),
        loss="mse",
    )
    with pytest.raises(ValueError, match="MultiOptimizer"):
        _fit(model, x, y, 2, callbacks=[FlushAccumulation()])


# 3. Layers inside custom layers ---------------------------------------------


@keras.saving.register_keras_serializable(package="tests")
class _Block(keras.layers.Layer):
    """A layer of one's own holding a batch normalization (of its inputs,
    the data, whatever the weights learn) and a Dense layer."""

    def __init__(self, accum_iters=None, **kwargs):
        super().__init__(**kwargs)
        self.accum_iters = accum_iters
        self.dense = keras.layers.Dense(3)
        self.norm = (
            keras.layers.BatchNormalization(momentum=0.5)
            if accum_iters is None
            else AccumBatchNormalization(accum_iters, momentum=0.5)
        )

    def call(self, inputs, training=None):
        return self.dense(self.norm(inputs, training=training))

    def get_config(self):
        return {**super().get_config(), "accum_iters": self.accum_iters}


def _block_model(accum_iters=None):
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [keras.Input((4,)), _Block(accum_iters), keras.layers.Dense(2)]
    )


def test_flush_reaches_batch_norm_inside_a_custom_layer():
    k, b = 3, 4
    x, y = regression_data(2, 2 * k * b + b)  # Each epoch ends one short.
    x = x * 2.0 + 1.0
    parent = _block_model()
    parent.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    _fit(parent, x, y, k * b)
    ours = _block_model(k)
    ours.compile(optimizer=SGDAccumulate(0.05, accum_iters=k), loss="mse")
    _fit(ours, x, y, b, callbacks=[FlushAccumulation()])
    norm = ours.layers[0].norm
    assert int(keras.ops.convert_to_numpy(norm.window_calls)) == 0
    for name in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(getattr(norm, name)),
            keras.ops.convert_to_numpy(getattr(parent.layers[0].norm, name)),
            rtol=1e-5,
            atol=1e-5,
        )


def test_swap_helper_refuses_batch_norm_inside_a_custom_layer():
    model = _block_model()
    with pytest.raises(ValueError, match=r"inside layer '_+block.* _Block"):
        with_accum_batch_norm(model, 2)


# 4. Negative sample weights -------------------------------------------------


def _dense_with_loss(reduction):
    model = small_model(4)
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    return model, loss


def _negative_weights(n):
    weights = np.ones(n, "float32")
    weights[4:7] = -2.0  # The second micro-batch's normalizer: -6 + 1.
    return weights


@pytest.mark.parametrize(
    "run_eagerly", [False, True], ids=["compiled", "eager"]
)
def test_negative_sample_weight_normalizer_is_refused(run_eagerly):
    x, y = regression_data(4, 16)
    model, loss = _dense_with_loss("mean_with_sample_weight")
    model.compile(
        optimizer=AdamAccumulate(accum_iters=3),
        loss=loss,
        run_eagerly=run_eagerly,
    )
    weigh_micro_batches(model)
    before = model.get_weights()
    # Compiled JAX code cannot raise: the refused micro-batch is left out
    # of its window, its loss is NaN (on which `TerminateOnNaN` stops), and
    # `fit` ends with the error.
    callbacks = [keras.callbacks.TerminateOnNaN()]
    with pytest.raises(Exception, match="normalizer") as error:
        _fit(
            model,
            x,
            y,
            4,
            epochs=1,
            sample_weight=_negative_weights(16),
            callbacks=callbacks,
        )
    assert "egative sample weights" in str(error.value)
    if BACKEND != "jax" or not run_eagerly:
        # (JAX's eager `fit` leaves no values after a failure.)
        _assert_close(model.get_weights(), before, atol=0)
        # The first micro-batch is in the window, the refused one is not.
        assert keras.ops.convert_to_numpy(model.optimizer.micro_steps) == 1


def test_zero_normalizer_is_kept_and_equals_the_big_batch():
    # A micro-batch whose samples all weigh 0 is legitimate.
    k, b = 2, 4
    x, y = regression_data(4, 4 * k * b)
    weights = np.linspace(0.5, 2.0, len(x)).astype("float32")
    weights[:b] = 0.0
    weights[3 * b : 4 * b] = 0.0
    parent, loss = _dense_with_loss("mean_with_sample_weight")
    parent.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    _fit(parent, x, y, k * b, sample_weight=weights)
    ours, loss = _dense_with_loss("mean_with_sample_weight")
    ours.compile(optimizer=AdamAccumulate(0.05, accum_iters=k), loss=loss)
    weigh_micro_batches(ours)
    _fit(ours, x, y, b, sample_weight=weights)
    _assert_close(ours.get_weights(), parent.get_weights())


# 6. Mask, sample weights and `mean_with_sample_weight` (torch in place) -----


def test_masked_sequences_with_sample_weights_equal_the_big_batch():
    k, b = 2, 3
    x, y = sequence_data(6, 2 * k * b + 2)
    # Per token, as the per-token loss (Keras broadcasts no per-sample
    # weights over a masked sequence).
    weights = np.linspace(0.2, 1.5, x.size).astype("float32").reshape(x.shape)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    parent = sequence_model(6)
    parent.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    _fit(parent, x, y, k * b, sample_weight=weights)
    ours = sequence_model(6)
    ours.compile(optimizer=SGDAccumulate(0.5, accum_iters=k), loss=loss)
    weigh_micro_batches(ours)
    _fit(ours, x, y, b, sample_weight=weights, callbacks=[FlushAccumulation()])
    _assert_close(ours.get_weights(), parent.get_weights())


# 8. Weights-only resume under mixed_float16 ---------------------------------


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize(
    "run_eagerly, multi",
    [(False, None), (True, None), (True, "map"), (False, "function")],
)
def test_weights_only_resume_keeps_the_loss_scale(
    tmp_path, mixed_float16, run_eagerly, multi
):
    # Large targets overflow float16 at the initial scale: the scale halves
    # and steps are skipped, so a restarted scale trains differently. Run
    # eagerly, the first step after the load scales its loss before the
    # loss scale is built (and restored), and must use the saved scale.
    # `multi`: around a `MultiOptimizer` of accumulating optimizers, named
    # by an `OptimizerMap`, or by a function: known only once built, so
    # built before the load, as the docs say.
    if multi and not hasattr(keras.optimizers, "MultiOptimizer"):
        pytest.skip("this Keras has no MultiOptimizer")
    x, y = regression_data(0, 40)
    y = y * 300.0

    def make():
        model = small_model(0, head_name="head")
        optimizer = AdamAccumulate(1e-2, accum_iters=3)
        if multi:
            head = SGDAccumulate(0.05, accum_iters=3)
            body = optimizer
            optimizer = keras.optimizers.MultiOptimizer(
                keras.optimizers.OptimizerMap(body, {".*/head/.*": head})
                if multi == "map"
                else lambda v: head if "/head/" in v.path else body
            )
        model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pending windows
        uninterrupted = make()
        _fit(uninterrupted, x, y, 4, epochs=2)
        first = make()
        _fit(first, x, y, 4, epochs=1)
        path = str(tmp_path / "half.weights.h5")
        first.save_weights(path)
        resumed = make()
        if multi == "function":
            resumed.optimizer.build(resumed.trainable_variables)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.load_weights(path)
        # No "Skipping variable loading" but Keras' own `MultiOptimizer`'s
        # for itself (its optimizers and the loss scale restore theirs).
        multi_name = resumed.optimizer.inner_optimizer.name
        assert not [
            message
            for message in map(str, (w.message for w in caught))
            if "Skipping variable loading" in message
            and not (multi == "map" and f"'{multi_name}'" in message)
        ]
        _fit(resumed, x, y, 4, epochs=1)
    scale = uninterrupted.optimizer.dynamic_scale
    assert float(keras.ops.convert_to_numpy(scale)) < 2.0**15  # not vacuous
    for name in ("dynamic_scale", "step_counter", "iterations"):
        assert float(
            keras.ops.convert_to_numpy(getattr(resumed.optimizer, name))
        ) == float(
            keras.ops.convert_to_numpy(getattr(uninterrupted.optimizer, name))
        ), name
    _assert_close(resumed.get_weights(), uninterrupted.get_weights(), atol=0)


# 9. The flush lands before validation and before checkpoints ---------------


def _val_pair(callbacks, k=3, b=4, n=28, dataset=False):
    """Ours with FlushAccumulation (epochs end 1 micro-batch short) and
    the parent on the big batch; validation data in `fit`."""
    x, y = regression_data(7, n)
    vx, vy = regression_data(8, 10)
    parent = small_model(7)
    parent.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    parent_history = _fit(parent, x, y, k * b, validation_data=(vx, vy))
    ours = small_model(7)
    ours.compile(optimizer=AdamAccumulate(0.05, accum_iters=k), loss="mse")
    if dataset:
        # Steps of unknown length: a generator, one epoch.
        def batches():
            for start in range(0, n, b):
                yield x[start : start + b], y[start : start + b]

        history = ours.fit(
            batches(),
            epochs=1,
            verbose=0,
            validation_data=(vx, vy),
            callbacks=list(callbacks),
        )
    else:
        history = _fit(
            ours, x, y, b, callbacks=callbacks, validation_data=(vx, vy)
        )
    return ours, parent, history, parent_history, (vx, vy)


def test_val_loss_is_computed_after_the_flush():
    ours, parent, history, parent_history, _ = _val_pair([FlushAccumulation()])
    np.testing.assert_allclose(
        history.history["val_loss"],
        parent_history.history["val_loss"],
        rtol=1e-5,
    )
    _assert_close(ours.get_weights(), parent.get_weights())


def test_val_loss_after_the_flush_with_steps_of_unknown_length():
    ours, parent, history, _, (vx, vy) = _val_pair(
        [FlushAccumulation()], dataset=True
    )
    # The parent after one epoch of the same batches.
    reference = small_model(7)
    reference.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    x, y = regression_data(7, 28)
    _fit(reference, x, y, 12, epochs=1)
    expected = reference.evaluate(vx, vy, verbose=0)
    np.testing.assert_allclose(
        history.history["val_loss"], [expected], rtol=1e-5
    )


def test_checkpoint_listed_first_saves_the_flushed_weights(tmp_path):
    path = str(tmp_path / "epoch.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    ours, parent, _, _, _ = _val_pair([checkpoint, FlushAccumulation()])
    saved = small_model(7)
    saved.load_weights(path)
    _assert_close(saved.get_weights(), parent.get_weights())


def test_evaluate_in_a_callback_mid_epoch_does_not_flush():
    x, y = regression_data(7, 20)
    model = small_model(7)
    model.compile(optimizer=AdamAccumulate(0.05, accum_iters=3), loss="mse")
    pending = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.evaluate(x, y, verbose=0)
                pending.append(int(self.model.optimizer.micro_steps))

    _fit(model, x, y, 4, epochs=1, callbacks=[Probe(), FlushAccumulation()])
    assert pending == [2]
    assert int(model.optimizer.micro_steps) == 0


# 10. Messages and the logger's counts ---------------------------------------


def test_logger_log_dir_that_is_no_path_is_refused_naming_it():
    with pytest.raises(TypeError, match="log_dir=123"):
        AccumulationLogger(log_dir=123)


def test_schedules_read_in_error_messages():
    ramp = LinearRamp(1, 4, ramp_updates=10)
    assert repr(ramp) == "LinearRamp(initial=1, final=4, ramp_updates=10)"
    optimizer = AdamAccumulate(accum_iters=ramp)
    assert "LinearRamp(initial=1" in repr(optimizer.accum_iters)


def test_logged_effective_batch_size_is_the_window_that_produced_the_update(
    tmp_path,
):
    pytest.importorskip("tensorboard")
    from helpers import tensorboard_scalars

    b = 2
    x, y = regression_data(3, 8 * b)
    model = small_model(3)
    # Windows of 1, 2, 3, 3... micro-batches (k at updates 0, 1, 2, ...).
    model.compile(
        optimizer=AdamAccumulate(accum_iters=LinearRamp(1, 3, 2)), loss="mse"
    )
    logger = AccumulationLogger(log_dir=tmp_path, batch_size=b, update_freq=1)
    _fit(model, x, y, b, epochs=1, callbacks=[logger])
    sizes = dict(
        tensorboard_scalars(tmp_path / "train")[
            "accumulation/effective_batch_size"
        ]
    )
    # After micro-batches 1, 3, 6: updates 1, 2, 3 from windows of 1, 2, 3.
    assert sizes[1] == 1 * b
    assert sizes[2] == 2 * b
    assert sizes[3] == 3 * b


@pytest.mark.backends("tensorflow", "jax")  # torch: steps_per_execution=1
def test_update_freq_counts_micro_batches_with_steps_per_execution():
    from test_accumulation_logger import _BatchLogs

    x, y = regression_data(3, 12 * 2)
    model = small_model(3)
    model.compile(
        optimizer=AdamAccumulate(accum_iters=2),
        loss="mse",
        steps_per_execution=3,
    )
    recorder = _BatchLogs()
    _fit(
        model,
        x,
        y,
        2,
        epochs=1,
        callbacks=[AccumulationLogger(update_freq=6), recorder],
    )
    # 4 executions of 3 micro-batches: logs after micro-batches 6 and 12.
    assert ["updates" in logs for logs in recorder.batches] == [
        False,
        True,
        False,
        True,
    ]
    assert recorder.batches[1]["updates"] == 3


@pytest.mark.backends("torch")
def test_torch_jit_compile_with_weighting_is_refused_naming_it():
    x, y = regression_data(3, 8)
    model = small_model(3)
    model.compile(
        optimizer=AdamAccumulate(accum_iters=2), loss="mse", jit_compile=True
    )
    weigh_micro_batches(model)
    with pytest.raises(ValueError, match="jit_compile=True"):
        _fit(model, x, y, 2, epochs=1)


def test_loss_scale_optimizer_apply_takes_weight_to_the_inner_optimizer():
    from test_weighted_windows import _linear_problem
    from test_weighted_windows import _mean_loss_gradient

    sizes = [4, 1, 3]
    initial, batches = _linear_problem(3, sizes)
    ours = [keras.Variable(w) for w in initial]
    wrapper = keras.optimizers.LossScaleOptimizer(
        SGDAccumulate(0.1, momentum=0.9, accum_iters=3), initial_scale=8.0
    )
    wrapper.build(ours)
    for x, y in batches:
        scaled = [
            keras.ops.convert_to_tensor(g * 8.0)
            for g in _mean_loss_gradient(initial, x, y)
        ]
        if BACKEND == "jax":
            state = wrapper.variables
            new, new_state = wrapper.stateless_apply(
                [v.value for v in state],
                scaled,
                [v.value for v in ours],
                weight=float(len(x)),
            )
            for variable, value in zip(ours + state, new + new_state):
                variable.assign(value)
        else:
            wrapper.apply(scaled, ours, weight=float(len(x)))
    x = np.concatenate([x for x, _ in batches])
    y = np.concatenate([y for _, y in batches])
    parent = [keras.Variable(w) for w in initial]
    keras.optimizers.SGD(0.1, momentum=0.9).apply(
        [
            keras.ops.convert_to_tensor(g)
            for g in _mean_loss_gradient(initial, x, y)
        ],
        parent,
    )
    _assert_close([v.numpy() for v in ours], [v.numpy() for v in parent])


def test_loss_scale_optimizer_refuses_a_bad_weight_naming_it():
    variables = [keras.Variable(np.ones((2,), "float32"))]
    wrapper = keras.optimizers.LossScaleOptimizer(
        SGDAccumulate(0.1, accum_iters=2)
    )
    wrapper.build(variables)
    grads = [keras.ops.ones((2,))]
    if BACKEND == "jax":
        pytest.skip("JAX runs a LossScaleOptimizer stateless only")
    with pytest.raises(ValueError, match="weight"):
        wrapper.apply(grads, variables, weight=-1.0)
    assert int(keras.ops.convert_to_numpy(wrapper.step_counter)) == 0
    assert (
        int(keras.ops.convert_to_numpy(wrapper.inner_optimizer.micro_steps))
        == 0
    )
    plain = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    plain.build(variables)
    # Keras' own class, which the package leaves as it is.
    with pytest.raises(TypeError, match="weight"):
        plain.apply(grads, variables, weight=2.0)
