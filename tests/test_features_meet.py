"""Where two features meet, each case ends exact or with an error that names
the problem and leaves the state as it was (issue 32's holes).

Oracles: the parent Keras optimizer on the big batch (the concatenated
micro-batches, the skipped ones left out), hand-computed values, Python's
own `inspect.signature`."""

import inspect
import warnings

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import regression_data
from helpers import small_model
from helpers import to_numpy
from modes import MODES
from modes import applier
from test_fit_to_memory import Injector

from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import fit_to_memory
from accum_optimizers.optimizers import OPTIMIZER_CLASSES

BACKEND = keras.backend.backend()


def _state(optimizer):
    return [to_numpy(v) for v in optimizer.variables]


# -- A call that raises writes nothing ----------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "bad_loss", [np.ones(2, "float32"), "abc"], ids=["vector", "string"]
)
def test_a_bad_loss_raises_naming_it_and_changes_nothing(mode, bad_loss):
    if mode != "eager" and isinstance(bad_loss, str):
        pytest.skip("a compiled function refuses a string argument itself")
    variable = keras.Variable(np.ones(3, "float32"))
    optimizer = SGDAccumulate(1.0, accum_iters=2)
    step = applier(optimizer, [variable], mode)
    gradient = np.ones(3, "float32")
    before = _state(optimizer)
    with pytest.raises(ValueError, match="`loss` must be a real scalar"):
        step([gradient], loss=bad_loss)
    assert_all_close(_state(optimizer), before, rtol=0, atol=0)
    # The next two good calls are one window of mean gradient 1, loss 2.
    step([gradient], loss=1.0)
    step([gradient], loss=3.0)
    assert_all_close(to_numpy(variable), np.zeros(3), rtol=0, atol=1e-7)
    assert float(to_numpy(optimizer.window_loss)) == pytest.approx(2.0)


def test_accum_iters_raised_on_an_optimizer_built_without_a_window_is_refused():
    variable = keras.Variable(np.ones(3, "float32"))
    optimizer = AdamAccumulate(0.1)
    optimizer.build([variable])
    with pytest.raises(ValueError, match="built with accum_iters=1"):
        optimizer.accum_iters = 4
    assert optimizer.accum_iters == 1
    optimizer.apply([keras.ops.ones((3,))], [variable])
    assert int(to_numpy(optimizer.iterations)) == 1


def test_accum_iters_changed_on_a_built_window_accumulates_exactly():
    variable = keras.Variable(np.ones(3, "float32"))
    reference = keras.Variable(np.ones(3, "float32"))
    optimizer = SGDAccumulate(0.5, accum_iters=2)
    optimizer.build([variable])
    optimizer.accum_iters = 3
    gradients = [np.full(3, g, "float32") for g in (1.0, 2.0, 6.0)]
    for gradient in gradients:
        optimizer.apply([keras.ops.convert_to_tensor(gradient)], [variable])
    parent = keras.optimizers.SGD(0.5)
    mean = keras.ops.convert_to_tensor(np.mean(gradients, axis=0))
    parent.apply([mean], [reference])
    assert_all_close(to_numpy(variable), to_numpy(reference), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", sorted(OPTIMIZER_CLASSES))
def test_every_class_signature_lists_every_accumulation_argument(name):
    cls = OPTIMIZER_CLASSES[name]
    parameters = inspect.signature(cls).parameters
    for argument in (
        "accum_iters",
        "skip_nonfinite",
        "accumulator_dtype",
        "measure_noise_scale",
    ):
        assert parameters[argument].kind is inspect.Parameter.KEYWORD_ONLY
        assert f"{argument}:" in cls.__doc__
    config = cls(accum_iters=3, skip_nonfinite=True).get_config()
    assert config["accum_iters"] == 3 and config["skip_nonfinite"] is True


# -- Window metrics under mixed precision -------------------------------------


def test_window_loss_under_mixed_float16_is_the_big_batchs_loss():
    x, y = regression_data(3, 16)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = small_model(3)
        model.compile(optimizer=SGDAccumulate(0.0, accum_iters=2), loss="mse")
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        expected = model.evaluate(x[8:], y[8:], batch_size=8, verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    window_loss = float(to_numpy(model.optimizer.inner_optimizer.window_loss))
    # Learning rate 0: the weights are the window's; float16 forward passes.
    assert window_loss == pytest.approx(expected, rel=2e-3)


# -- The logger under steps_per_execution -------------------------------------


@pytest.mark.backends("tensorflow", "jax")  # torch runs one step at a time
def test_logger_warns_when_an_execution_applies_several_updates():
    x, y = regression_data(1, 32)
    model = small_model(1)
    model.compile(
        optimizer=SGDAccumulate(0.1, accum_iters=2),
        loss="mse",
        steps_per_execution=4,
    )
    logger = AccumulationLogger(update_freq="batch")
    with pytest.warns(UserWarning, match="steps_per_execution=4"):
        model.fit(
            x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[logger]
        )
    model.compile(
        optimizer=SGDAccumulate(0.1, accum_iters=2),
        loss="mse",
        steps_per_execution=2,
    )
    logger = AccumulationLogger(update_freq="batch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[logger]
        )
    assert not [w for w in caught if "steps_per_execution" in str(w.message)]
    assert logger.windows["updates"] == [1, 2, 3, 4]


# -- fit_to_memory's recovery -------------------------------------------------


def _parent_on_windows(x, y, windows, learning_rate):
    model = small_model(0)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse")
    for indices in windows:
        model.train_on_batch(x[indices], y[indices])
    return model


def test_probes_that_ran_out_of_memory_leave_no_stale_state():
    # The last probe (8 samples) fails after one (6) that closed a window.
    x, y = regression_data(0, 48)
    model = small_model(0)
    model.compile(optimizer=AdamAccumulate(0.02), loss="mse")
    Injector(model, [(0, 7)])
    history = fit_to_memory(
        model, x, y, target_batch_size=24, epochs=2, shuffle=False, verbose=0
    )
    assert history.plan.micro_batch_size == 6
    assert int(to_numpy(model.optimizer.iterations)) == 4
    windows = [np.arange(0, 24), np.arange(24, 48)] * 2
    parent = _parent_on_windows(x, y, windows, 0.02)
    assert_all_close(
        model.get_weights(), parent.get_weights(), rtol=0, atol=2e-6
    )


def _recovery_refused(nan_row, rules):
    """`fit_to_memory` in windows of 12 (micro-batches of 4) with sample
    `nan_row` NaN (its micro-batch skipped, the window regrouped) and the
    out-of-memory `rules`: refused; returns the model and the error."""
    x, y = regression_data(0, 48)
    x[nan_row, 0] = np.nan
    model = small_model(0)
    model.compile(
        optimizer=AdamAccumulate(0.02, skip_nonfinite=True), loss="mse"
    )
    Injector(model, rules)
    with pytest.raises(RuntimeError, match="regrouped") as error:
        fit_to_memory(
            model,
            x,
            y,
            target_batch_size=12,
            micro_batch_size=4,
            shuffle=False,
            verbose=0,
        )
    return model, error.value


def test_a_recovery_in_a_window_a_skip_regrouped_is_refused_naming_it():
    # Micro-batch 0 is skipped; the out-of-memory error is in its window.
    model, error = _recovery_refused(1, [(3, 2)])
    assert "skip_nonfinite" in str(error)
    # The failed step wrote nothing: two finite micro-batches pending. (An
    # error inside the window's update: test_fault_injection.py.)
    assert int(to_numpy(model.optimizer.micro_steps)) == 2
    assert int(to_numpy(model.optimizer.iterations)) == 0


def test_a_recovery_in_a_later_window_of_a_regrouped_epoch_is_refused():
    # Windows of 12: the skip (samples 4-7) is in the first, which then
    # closes on sample 15; the OOM is in the second, at sample 16.
    _recovery_refused(5, [(4, 2)])


# -- Negative and non-finite sample weights -----------------------------------


def _weighted_model(optimizer, **compile_options):
    from accum_optimizers import weigh_micro_batches

    model = small_model(2)
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    model.compile(optimizer=optimizer, loss=loss, **compile_options)
    return weigh_micro_batches(model)


@pytest.mark.parametrize("flush", [False, True])
def test_negative_sample_weights_never_move_the_weights_and_are_named(flush):
    # With `FlushAccumulation` too, which takes over the end of `fit`'s
    # pending-window warning but not the refusal.
    x, y = regression_data(2, 16)
    model = _weighted_model(SGDAccumulate(0.1, accum_iters=2))
    before = model.get_weights()
    with pytest.raises(Exception, match="normalizer"):
        model.fit(
            x,
            y,
            sample_weight=-np.ones(16, "float32"),
            batch_size=4,
            shuffle=False,
            verbose=0,
            callbacks=[FlushAccumulation()] if flush else [],
        )
    # Every micro-batch was refused (compiled JAX code leaves each out of
    # its window and `fit` raises at its end): nothing moved.
    assert_all_close(model.get_weights(), before, rtol=0, atol=0)
    assert int(to_numpy(model.optimizer.iterations)) == 0


def test_a_nan_normalizer_under_skip_nonfinite_is_skipped_on_every_backend():
    x, y = regression_data(2, 16)
    weights = np.ones(16, "float32")
    weights[5] = np.nan  # micro-batch 1
    model = _weighted_model(
        SGDAccumulate(0.1, accum_iters=2, skip_nonfinite=True)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pending window at the end
        model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=4,
            shuffle=False,
            verbose=0,
        )
    optimizer = model.optimizer
    assert int(to_numpy(optimizer.skipped_micro_batches)) == 1
    assert int(to_numpy(optimizer.iterations)) == 1
    parent = small_model(2)
    parent.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    kept = np.r_[0:4, 8:12]
    parent.train_on_batch(x[kept], y[kept])
    assert_all_close(
        model.get_weights(), parent.get_weights(), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_negative_normalizer_under_skip_nonfinite_is_refused_in_every_mode(
    mode,
):
    # Not a non-finite micro-batch to skip: refused as without
    # `skip_nonfinite`. Eagerly and in a TensorFlow graph at once; compiled
    # code (XLA, JAX) cannot raise: it leaves the micro-batch out, counts
    # it apart from the skips, and `fit` raises at its end.
    x, y = regression_data(2, 16)
    weights = np.ones(16, "float32")
    weights[4:8] = -1.0  # micro-batch 1's normalizer: -4
    model = _weighted_model(
        SGDAccumulate(0.1, accum_iters=2, skip_nonfinite=True),
        run_eagerly=mode == "eager",
        jit_compile=mode in ("xla", "jit"),
    )
    initial = model.get_weights()
    with pytest.raises(Exception, match="normalizer"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the pending window at the end
            model.fit(
                x,
                y,
                sample_weight=weights,
                batch_size=4,
                shuffle=False,
                verbose=0,
            )
    optimizer = model.optimizer
    assert int(to_numpy(optimizer.skipped_micro_batches)) == 0
    parent = small_model(2)
    parent.set_weights(initial)
    parent.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    if mode in ("xla", "jit"):
        assert int(to_numpy(optimizer.refused_micro_batches)) == 1
        # Micro-batches 0 and 2 made the window; 3 is pending.
        kept = np.r_[0:4, 8:12]
        parent.train_on_batch(x[kept], y[kept])
    else:
        assert int(to_numpy(optimizer.micro_steps)) == 1  # micro-batch 0
    assert_all_close(
        model.get_weights(), parent.get_weights(), rtol=0, atol=1e-6
    )
