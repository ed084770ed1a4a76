"""Off the happy path: every case ends exact or with an error naming the
problem, never silently wrong. Oracles: the parent Keras optimizer fed the
window's mean gradient, hand-computed values, Keras' own behaviour."""

import copy
import re
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import fit_in_order
from helpers import fit_interrupted
from helpers import parent_on_window_means
from helpers import random_variables
from helpers import regression_data
from helpers import small_model
from helpers import to_numpy
from helpers import window_state
from modes import MODES
from modes import applier

from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate

tensor = keras.ops.convert_to_tensor


def _variables(seed=0, shapes=((3, 2), (2,), (2, 1))):
    return random_variables(seed, shapes)


def _draw(rng, variables, missing=()):
    return [
        None
        if i in missing
        else rng.normal(size=tuple(v.shape)).astype("float32")
        for i, v in enumerate(variables)
    ]


# 1. Variables left out of a call ------------------------------------------


@pytest.mark.parametrize("subset", [True, False], ids=["subset", "None"])
@pytest.mark.parametrize("mode", MODES)
def test_left_out_variables_count_as_zero_in_their_window_in_every_mode(
    mode, subset
):
    if mode == "jit" and subset:
        pytest.skip("stateless_apply takes one gradient per variable")
    k = 3
    rng = np.random.default_rng(1)
    ours_vars = _variables()
    ours = AdamAccumulate(0.1, accum_iters=k)
    step = applier(ours, ours_vars, mode, subset=subset)
    # Window 1 complete; windows 2-3 leave the head (variable 2) out of
    # their first call, and a layer "unfrozen" in window 3's second call;
    # window 4 leaves the head out of the call that closes it (the big
    # batch still moves it); window 5 never reaches variable 1 (Adam's
    # momentum must not move it, as the parent leaves it alone); window 6
    # alternates two heads, as micro-batches of two tasks do.
    windows = [
        [_draw(rng, ours_vars) for _ in range(k)],
        [_draw(rng, ours_vars, missing={2})]
        + [_draw(rng, ours_vars) for _ in range(k - 1)],
        [_draw(rng, ours_vars, missing={0, 2})]
        + [_draw(rng, ours_vars) for _ in range(k - 1)],
        [_draw(rng, ours_vars) for _ in range(k - 1)]
        + [_draw(rng, ours_vars, missing={2})],
        [_draw(rng, ours_vars, missing={1}) for _ in range(k)],
        [_draw(rng, ours_vars, missing={1 + i % 2}) for i in range(k)],
    ]
    for window in windows:
        for grads in window:
            step(grads)

    parent_vars = _variables()
    parent = keras.optimizers.Adam(0.1)
    parent_on_window_means(parent, parent_vars, windows)
    assert_all_close(ours_vars, parent_vars, rtol=1e-5, atol=1e-6)
    assert int(ours.iterations) == len(windows)


# 2. flush touches only what is trainable now and received gradient ----------


@pytest.mark.parametrize(
    "cls, parent_cls",
    [
        (SGDAccumulate, keras.optimizers.SGD),
        (AdamAccumulate, keras.optimizers.Adam),
    ],
)
def test_flush_leaves_frozen_and_gradient_less_layers_alone(cls, parent_cls):
    options = {"learning_rate": 0.1}
    if cls is SGDAccumulate:
        options["momentum"] = 0.9
    rng = np.random.default_rng(2)
    ours_vars, parent_vars = _variables(), _variables()
    ours, parent = cls(accum_iters=4, **options), parent_cls(**options)
    window = [_draw(rng, ours_vars) for _ in range(4)]
    for grads in window:  # a full window: momentum on every variable
        ours.apply([tensor(g) for g in grads], ours_vars)
    parent_on_window_means(parent, parent_vars, [window])

    pending = [_draw(rng, ours_vars, missing={2}) for _ in range(2)]
    for grads in pending:
        ours.apply([None if g is None else tensor(g) for g in grads], ours_vars)
    ours_vars[0].trainable = False  # frozen after build, mid-window
    before = to_numpy(ours_vars)
    ours.flush()
    after = to_numpy(ours_vars)
    np.testing.assert_array_equal(after[0], before[0])  # frozen now
    np.testing.assert_array_equal(after[2], before[2])  # no gradient
    parent_on_window_means(parent, parent_vars, [pending], updated=[1])
    assert_all_close(ours_vars[1:2], parent_vars[1:2], rtol=1e-5, atol=1e-6)
    assert int(ours.micro_steps) == 0


def test_flush_of_a_window_that_reached_frozen_variables_only_is_no_update():
    # The parent applies nothing without a trainable variable's gradient:
    # no update, no count, the window dropped.
    rng = np.random.default_rng(4)
    ours_vars = _variables()
    ours = AdamAccumulate(0.1, accum_iters=4)
    ours.build(ours_vars)
    for grads in [_draw(rng, ours_vars, missing={1, 2}) for _ in range(2)]:
        ours.apply([None if g is None else tensor(g) for g in grads], ours_vars)
    ours_vars[0].trainable = False
    before = to_numpy(ours_vars)
    ours.flush()
    for after, was in zip(to_numpy(ours_vars), before):
        np.testing.assert_array_equal(after, was)
    assert int(ours.iterations) == 0
    assert int(ours.micro_steps) == 0
    assert float(ours.samples_seen) == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_flush_updates_a_variable_whose_gradient_came_early_in_the_window(
    mode,
):
    # Variables 0 and 2 receive gradient in the first micro-step only: the
    # flushed window still holds it, and the big batch's update moves them.
    rng = np.random.default_rng(9)
    ours_vars, parent_vars = _variables(), _variables()
    ours = AdamAccumulate(0.1, accum_iters=3)
    step = applier(ours, ours_vars, mode)
    pending = [_draw(rng, ours_vars), _draw(rng, ours_vars, missing={0, 2})]
    for grads in pending:
        step(grads)
    ours.flush()
    parent = keras.optimizers.Adam(0.1)
    parent_on_window_means(parent, parent_vars, [pending], updated="any")
    assert_all_close(ours_vars, parent_vars, rtol=1e-5, atol=1e-6)
    assert int(ours.iterations) == 1


# 3. A call that raises changes nothing; shapes are never broadcast ---------


def _state(optimizer, variables):
    return to_numpy(variables) + to_numpy(optimizer.variables)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("position", [0, 1], ids=["first", "closing"])
def test_a_wrong_shaped_gradient_raises_and_changes_nothing(mode, position):
    k = 2
    rng = np.random.default_rng(3)
    ours_vars = _variables(shapes=((4, 1), (1,)))
    ours = SGDAccumulate(1.0, accum_iters=k)
    step = applier(ours, ours_vars, mode)
    window = [_draw(rng, ours_vars) for _ in range(k)]
    for grads in window[:position]:
        step(grads)
    before = _state(ours, ours_vars)
    bad = [np.ones((1, 1), "float32"), window[position][1]]  # broadcasts
    with pytest.raises(Exception, match=r"shape \(1, 1\).*\(4, 1\)"):
        step(bad)
    for a, b in zip(_state(ours, ours_vars), before):
        np.testing.assert_array_equal(a, b)
    for grads in window[position:]:
        step(grads)
    parent_vars = _variables(shapes=((4, 1), (1,)))
    parent_on_window_means(keras.optimizers.SGD(1.0), parent_vars, [window])
    assert_all_close(ours_vars, parent_vars, rtol=1e-5, atol=1e-6)


def test_a_call_with_the_wrong_number_of_gradients_changes_nothing():
    ours_vars = _variables()
    ours = SGDAccumulate(accum_iters=2)
    ours.build(ours_vars)
    before = _state(ours, ours_vars)
    with pytest.raises(ValueError, match="Received 2 gradients for 3"):
        ours.apply([np.ones((3, 2)), np.ones(2)], ours_vars)
    with pytest.raises(ValueError, match="No gradients provided"):
        ours.apply([None, None, None], ours_vars)
    for a, b in zip(_state(ours, ours_vars), before):
        np.testing.assert_array_equal(a, b)


# 4-6. Saving and loading ---------------------------------------------------


def _compiled(accum_iters, seed=3, **options):
    model = small_model(seed)
    model.compile(
        optimizer=AdamAccumulate(accum_iters=accum_iters, **options),
        loss="mse",
    )
    return model


@pytest.mark.parametrize("accum_iters", [1, 4])
def test_a_model_saved_before_training_loads_and_trains(accum_iters, tmp_path):
    x, y = regression_data(4, 16)
    saved = _compiled(accum_iters)
    path = tmp_path / "untrained.keras"
    saved.save(path)
    loaded = keras.saving.load_model(path)
    fit_in_order(loaded, x, y, batch_size=2)
    fit_in_order(saved, x, y, batch_size=2)
    assert_all_close(loaded.weights, saved.weights, rtol=1e-6, atol=1e-7)
    assert int(loaded.optimizer.iterations) == 8 // accum_iters


@pytest.mark.parametrize("accum_iters", [1, 4])
def test_weights_only_resume_into_an_unbuilt_optimizer_is_exact(
    accum_iters, tmp_path
):
    k, b = accum_iters, 2
    x, y = regression_data(5, 4 * 4 * b)
    path = tmp_path / "ckpt.weights.h5"
    checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    uninterrupted, _ = fit_interrupted(
        lambda: _compiled(k, amsgrad=True), x, y, 6 * b, b, [checkpoint]
    )
    restored = _compiled(k, amsgrad=True)  # optimizer not built
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "Skipping" warning
        restored.load_weights(path)
    fit_in_order(restored, x[6 * b :], y[6 * b :], batch_size=b)
    assert_all_close(
        restored.weights, uninterrupted.weights, rtol=1e-6, atol=1e-7
    )
    assert_all_close(
        restored.optimizer.variables,
        uninterrupted.optimizer.variables,
        rtol=1e-6,
        atol=1e-7,
    )


def test_deepcopy_of_a_built_optimizer_keeps_its_pending_window():
    rng = np.random.default_rng(6)
    ours_vars = _variables()
    ours = AdamAccumulate(0.1, accum_iters=3)
    window = [_draw(rng, ours_vars) for _ in range(3)]
    for grads in window[:2]:
        ours.apply([tensor(g) for g in grads], ours_vars)
    copied = copy.deepcopy(ours)
    copied.build(ours_vars)
    assert int(copied.micro_steps) == 2
    assert_all_close(copied.variables, ours.variables, rtol=0, atol=0)
    copied.apply([tensor(g) for g in window[2]], ours_vars)
    parent_vars = _variables()
    parent_on_window_means(keras.optimizers.Adam(0.1), parent_vars, [window])
    assert_all_close(ours_vars, parent_vars, rtol=1e-5, atol=1e-6)


def _saved_state(accum_iters, pending, windows=1):
    rng = np.random.default_rng(7)
    variables = _variables()
    optimizer = AdamAccumulate(0.1, accum_iters=accum_iters)
    calls = [_draw(rng, variables) for _ in range(windows * accum_iters)]
    for grads in calls[: (windows - 1) * accum_iters + pending]:
        optimizer.apply([tensor(g) for g in grads], variables)
    store = {}
    optimizer.save_own_variables(store)
    return store, calls


def test_a_pending_window_larger_than_accum_iters_is_refused():
    store, _ = _saved_state(accum_iters=4, pending=3)
    other = AdamAccumulate(0.1, accum_iters=2)
    other.build(_variables())
    before = to_numpy(other.variables)
    with pytest.raises(ValueError, match=r"3 micro-batches.*accum_iters=2"):
        other.load_own_variables(store)
    assert_all_close(
        other.variables, before, rtol=0, atol=0
    )  # nothing assigned


def test_a_pending_window_that_fits_continues_under_a_larger_accum_iters():
    store, calls = _saved_state(accum_iters=2, pending=1, windows=2)
    variables = _variables()
    parent = keras.optimizers.Adam(0.1)
    parent_on_window_means(parent, variables, [calls[:2]])
    ours_vars = [keras.Variable(v) for v in to_numpy(variables)]
    ours = AdamAccumulate(0.1, accum_iters=3)
    ours.build(ours_vars)
    ours.load_own_variables(store)
    assert int(ours.micro_steps) == 1
    extra = _draw(np.random.default_rng(8), ours_vars)
    for grads in [calls[3], extra]:
        ours.apply([tensor(g) for g in grads], ours_vars)
    parent_on_window_means(parent, variables, [[calls[2], calls[3], extra]])
    assert_all_close(ours_vars, variables, rtol=1e-5, atol=1e-6)
    assert int(ours.iterations) == 2


@pytest.mark.parametrize("micro_steps", [9, -3])
def test_corrupt_counters_are_refused(micro_steps):
    store, _ = _saved_state(accum_iters=4, pending=2)
    optimizer = AdamAccumulate(0.1, accum_iters=4)
    optimizer.build(_variables())
    index = next(
        i
        for i, v in enumerate(optimizer.variables)
        if v is window_state(optimizer)["micro_steps"]
    )
    store[str(index)] = np.array(micro_steps, "int32")
    with pytest.raises(ValueError, match=f"micro.*{micro_steps}"):
        optimizer.load_own_variables(store)


def test_a_pending_window_cannot_load_into_accum_iters_1():
    store, _ = _saved_state(accum_iters=4, pending=2)
    optimizer = AdamAccumulate(0.1)
    optimizer.build(_variables())
    with pytest.raises(ValueError, match=r"2 micro-batches.*accum_iters=1"):
        optimizer.load_own_variables(store)


def test_a_state_saved_between_windows_loads_into_any_accum_iters():
    store, calls = _saved_state(accum_iters=2, pending=0, windows=2)
    for accum_iters in (1, 3):
        optimizer = AdamAccumulate(0.1, accum_iters=accum_iters)
        optimizer.build(_variables())
        optimizer.load_own_variables(store)
        assert int(optimizer.iterations) == 1
        assert int(optimizer.micro_steps) == 0


# 7. Construction -----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decay": float("inf")}, "decay=inf"),
        ({"decay": 1e39}, "decay=1e+39"),
        ({"accum_iters": 2**40}, f"accum_iters={2**40}"),
        (
            {"accum_iters": 2, "accumulator_dtype": "float8_e4m3fn"},
            "accumulator_dtype='float8_e4m3fn'",
        ),
        (
            {"accum_iters": 2, "accumulator_dtype": "bogus"},
            "accumulator_dtype='bogus'",
        ),
        ({"lr": 0.1, "learning_rate": 0.001}, "learning_rate=0.001, lr=0.1"),
    ],
)
def test_bad_configuration_fails_at_construction(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises((ValueError, TypeError), match=re.escape(message)):
            AdamAccumulate(**kwargs)


# 8. A flush never applies a non-finite window -----------------------------


def test_flush_after_terminate_on_nan_keeps_the_weights_finite():
    x, y = regression_data(9, 24)
    x[10] = np.nan  # micro-batch 6 of 12: the second window's second
    model = _compiled(4)
    with pytest.warns(UserWarning, match="non-finite"):
        fit_in_order(
            model,
            x,
            y,
            batch_size=2,
            callbacks=[keras.callbacks.TerminateOnNaN(), FlushAccumulation()],
        )
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.iterations) == 1
    assert int(model.optimizer.micro_steps) == 0


# 9. float8 scale variables keep the window's maximum ------------------------


@pytest.mark.parametrize("mode", MODES)
def test_overwrite_with_gradient_variables_take_the_window_maximum(mode):
    rng = np.random.default_rng(10)
    scale = keras.Variable(np.zeros(3, "float32"))
    scale.overwrite_with_gradient = True
    kernel = keras.Variable(np.ones(3, "float32"))
    ours = SGDAccumulate(0.1, accum_iters=3)
    step = applier(ours, [scale, kernel], mode)
    window = [rng.normal(size=(2, 3)).astype("float32") for _ in range(3)]
    for i, (g_scale, g_kernel) in enumerate(window):
        step([g_scale, g_kernel])
        if i < 2:
            np.testing.assert_array_equal(to_numpy(scale), np.zeros(3))
    np.testing.assert_allclose(
        to_numpy(scale), np.max([w[0] for w in window], axis=0)
    )
    np.testing.assert_allclose(
        to_numpy(kernel),
        1 - 0.1 * np.mean([w[1] for w in window], axis=0),
        rtol=1e-6,
    )


# Which micro-steps of a window of 3 give each variable a gradient: the
# float8 scale's missing from the closing call, with and without a summed
# variable missing too (compiled code then masks both), and never.
_OVERWRITE_PATTERNS = {
    "scale_not_closing": {"scale": (1, 1, 0), "kernel": (1, 1, 1)},
    "scale_first_only": {"scale": (1, 0, 0), "kernel": (1, 1, 0)},
    "scale_after_open": {"scale": (0, 1, 0), "kernel": (1, 1, 1)},
    "scale_never": {"scale": (0, 0, 0), "kernel": (1, 0, 1)},
}


@pytest.mark.parametrize("pattern", _OVERWRITE_PATTERNS)
@pytest.mark.parametrize("mode", MODES)
def test_overwrite_with_gradient_variables_follow_the_big_batch(mode, pattern):
    # The parent on the big batch overwrites a float8 scale with its
    # gradient (the maximum over the batch) wherever any micro-batch gave
    # it one, whichever call closes the window (contract item 14).
    presence = _OVERWRITE_PATTERNS[pattern]
    rng = np.random.default_rng(11)
    bias = np.ones(3, "float32")

    def variables():
        scale = keras.Variable(np.full(3, 5.0, "float32"), name="scale")
        scale.overwrite_with_gradient = True
        kernel = keras.Variable(np.ones(3, "float32"), name="kernel")
        return [scale, kernel, keras.Variable(bias, name="bias")]

    ours = variables()
    step = applier(SGDAccumulate(0.1, accum_iters=3), ours, mode)
    windows = []
    # Two windows: the second's maximum owes nothing to the first's.
    for _ in range(2):
        window = [rng.normal(size=(3, 3)).astype("float32") for _ in range(3)]
        windows.append(window)
        for j, grads in enumerate(window):
            step(
                [
                    grads[0] if presence["scale"][j] else None,
                    grads[1] if presence["kernel"][j] else None,
                    grads[2],
                ]
            )
    theirs = variables()
    parent = keras.optimizers.SGD(0.1)
    parent.build(theirs)
    for window in windows:
        big, big_variables = [], []
        scales = [g[0] for g, p in zip(window, presence["scale"]) if p]
        if scales:
            big.append(np.max(scales, axis=0))
            big_variables.append(theirs[0])
        kernel = [g[1] * p for g, p in zip(window, presence["kernel"])]
        big += [np.mean(kernel, axis=0), np.mean([g[2] for g in window], 0)]
        big_variables += theirs[1:]
        big = [keras.ops.convert_to_tensor(g) for g in big]
        parent.apply(big, big_variables)
    for mine, expected in zip(ours, theirs):
        np.testing.assert_allclose(
            to_numpy(mine), to_numpy(expected), rtol=1e-6, err_msg=mine.name
        )


# 10. python -OO ------------------------------------------------------------


# Docstrings are backend-independent; one backend's import is enough.
@pytest.mark.backends("torch")
def test_the_package_imports_under_python_oo():
    def import_oo(module):
        return subprocess.run(
            [sys.executable, "-OO", "-c", f"import {module}"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    result = import_oo("accum_optimizers")
    if result.returncode != 0 and import_oo("keras").returncode != 0:
        # Keras 3.13 on torch edits a docstring that -OO removed.
        pytest.skip(f"Keras {keras.version()} itself fails under -OO")
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_window_saved_by_0_1_0_without_mask_and_weight_resumes():
    store, calls = _saved_state(accum_iters=3, pending=2)
    optimizer = AdamAccumulate(0.1, accum_iters=3)
    variables = _variables()
    optimizer.build(variables)
    # Of the window's state, 0.1.0 saved only its two counters.
    newer = [
        window_state(optimizer)["seen"],
        window_state(optimizer)["total_weight"],
        window_state(optimizer)["skipped"],
        window_state(optimizer)["samples_seen"],
        window_state(optimizer)["samples_seen_error"],
        window_state(optimizer)["loss_sum"],
        window_state(optimizer)["window_loss"],
        window_state(optimizer)["window_grad_norm"],
        window_state(optimizer)["refused"],
    ]
    absent = {
        i
        for i, v in enumerate(optimizer.variables)
        if any(v is n for n in newer)
    }
    old = [store[str(i)] for i in range(len(store)) if i not in absent]
    optimizer.load_own_variables({str(i): v for i, v in enumerate(old)})
    assert int(optimizer.micro_steps) == 2
    optimizer.apply([tensor(g) for g in calls[2]], variables)
    parent_vars = _variables()
    parent_on_window_means(keras.optimizers.Adam(0.1), parent_vars, [calls])
    assert_all_close(variables, parent_vars, rtol=1e-5, atol=1e-6)


def test_a_schedule_state_loaded_into_a_float_learning_rate_is_refused():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    saved = AdamAccumulate(schedule, accum_iters=3)
    saved.build(_variables())
    store = {}
    saved.save_own_variables(store)
    optimizer = AdamAccumulate(0.1, accum_iters=3)
    optimizer.build(_variables())
    with pytest.raises(ValueError, match="Cannot restore"):
        optimizer.load_own_variables(store)


def test_a_window_loaded_into_accum_iters_1_warns_of_the_counts_it_restarts():
    # Oracle: what the saved window counted, by hand: two windows of two
    # micro-batches weighing 3 each, against an optimizer without a window,
    # which reports its update count.
    variables = _variables()
    saved = SGDAccumulate(0.1, accum_iters=2)
    saved.build(variables)
    grads = [keras.ops.ones(v.shape) for v in variables]
    for _ in range(4):
        saved.apply(grads, variables, weight=3.0)
    store = {str(i): to_numpy(v) for i, v in enumerate(saved.variables)}
    loaded = SGDAccumulate(0.1)
    loaded.build(_variables())
    with pytest.warns(UserWarning, match="samples_seen=12"):
        loaded.load_own_variables(store)
    assert int(to_numpy(loaded.iterations)) == 2
    assert float(to_numpy(loaded.samples_seen)) == 2.0


def test_a_weight_left_for_a_collected_optimizer_reaches_no_other():
    """What `weigh_micro_batches` or a wrapper hands an optimizer's next
    `apply` is kept by the optimizer's `id`; Python gives a collected
    object's `id` to new ones. An entry left by an optimizer that is gone
    (its `id` now another's) is not taken by the new one: its window
    counts what its own micro-batches weigh."""
    from accum_optimizers import _inputs

    gone = SGDAccumulate(accum_iters=2)
    _inputs.hand_over(gone, _inputs.Handoff(weight=5.5))
    entry = _inputs._pending().pop(id(gone))
    optimizer = SGDAccumulate(learning_rate=0.1, accum_iters=2)
    _inputs._pending()[id(optimizer)] = entry  # as if `id` were reused
    variables = [keras.Variable(np.ones(2, "float32"))]
    for _ in range(2):
        optimizer.apply([keras.ops.ones(2)], variables)
    assert float(to_numpy(optimizer.samples_seen)) == 2.0
    assert id(optimizer) not in _inputs._pending()


def test_accum_iters_set_below_the_pending_window_is_refused():
    """As a load into it would be: the pending window holds 2, a window of
    2 continues at most 1. A larger value is taken, with a warning that a
    compiled train function keeps the size it was traced with."""
    variables = [keras.Variable(np.ones(2, "float32"))]
    optimizer = SGDAccumulate(learning_rate=0.1, accum_iters=4)
    for _ in range(2):
        optimizer.apply([keras.ops.ones(2)], variables)
    state = [to_numpy(v) for v in optimizer.variables]
    with pytest.raises(ValueError, match="pending window of 2 micro-batches"):
        optimizer.accum_iters = 2
    assert optimizer.accum_iters == 4
    for a, e in zip((to_numpy(v) for v in optimizer.variables), state):
        np.testing.assert_array_equal(a, e)
    with pytest.warns(UserWarning, match="make_train_function"):
        optimizer.accum_iters = 3
    optimizer.apply([keras.ops.ones(2)], variables)
    assert int(to_numpy(optimizer.iterations)) == 1
