"""Fault injection (issue 32): an error raised at each point of a `fit`
micro-step and of a `fit_to_memory` step, in every execution mode of the
backend, must leave a state the contract allows (DESIGN.md 2.7, 2.12):

- in `fit`, the error propagates, naming what happened, and the model's
  weights and the optimizer's variables are those after the last step that
  succeeded (a snapshot taken by a callback after each step);
- in `fit_to_memory`, the backend's out-of-memory error inside a step is
  recovered from and training ends exactly where the parent Keras
  optimizer at the target batch ends; outside a step (a callback) it
  propagates with the state of the last step.

The points (`faults.py`): the data (a `PyDataset` raising at batch i), the
forward pass (a layer), the backward pass (a custom gradient), the parent's
update in a window's close (the public Keras parent class's `update_step`,
patched) and a callback. The errors are raised while the step runs, from
inside compiled code where the mode has it (`tf.py_function`,
`jax.pure_callback`); TensorFlow's XLA runs no Python, so there only the
data and callback points are injected.

Every optimizer here measures the gradient noise scale (`NOISE`): its
variables (the window's noise sums, the last window's estimates, their
moving averages) are among the optimizer's variables a failed step must
leave as they were; so are those of the lone Adam's learning rate, a
scaling rule that follows the window (the last window's `S`, the
scale-invariant step). The `MultiOptimizer` runs inside a
`LossScaleOptimizer`, as `compile` wraps it under `mixed_float16`.
"""

import keras
import numpy as np
import pytest
from faults import MESSAGE
from faults import FailingCallback
from faults import FailingData
from faults import Fault
from faults import Snapshot
from faults import differences
from faults import model_with
from faults import out_of_memory_error
from faults import patch_parent_update_step
from faults import state_of
from faults import tap_supported
from fuzz_runs import MemoryRun
from fuzz_runs import Run
from fuzz_runs import accumulating
from fuzz_runs import assert_same_run
from fuzz_runs import data
from fuzz_runs import outcome
from fuzz_runs import train_parent_to_memory
from helpers import assert_all_close
from helpers import parent_on_window_means
from helpers import random_variables
from helpers import to_numpy
from modes import MODES

import accum_optimizers as ao

BACKEND = keras.backend.backend()
ACCUM_ITERS, MICRO_BATCH, SAMPLES = 3, 2, 16
# The optimizers' arguments besides: the noise scale's variables are
# written in every micro-step and close, so a failed one must leave them.
NOISE = {"measure_noise_scale": True, "noise_scale_momentum": 0.5}
# (point, at): the pass of that point that fails. Micro-step 1 adds to a
# pending window, micro-step 2 closes it; the parent's update runs once
# per variable (4 of them) in each close: pass 1 is the first close's
# second variable, pass 4 the second close's first.
CASES = [
    ("data", 2),
    ("forward", 1),
    ("forward", 2),
    ("backward", 1),
    ("backward", 2),
    ("update", 1),
    ("update", 4),
    ("callback", 2),
]


# Holes found and not fixed yet, by (test, mode, point, at): the reason,
# and whether the failure is certain (strict xfail) or depends on the order
# TensorFlow's graph runs independent ops in. Whoever fixes one removes it.
HOLES = {"step": {}, "memory": {}}

# Where a step cannot be undone, the error says so: eagerly, an error
# inside the parent's update carries a note; `fit_to_memory` stops with a
# `RuntimeError` instead of retrying.
PARTLY_WRITTEN = "had begun to write the optimizer's state"
CANNOT_RETRY = "cannot be undone"


def _mark_known_hole(request, test, key):
    if key in HOLES[test]:
        reason, certain = HOLES[test][key]
        request.node.add_marker(
            pytest.mark.xfail(strict=certain, reason=f"hole: {reason}")
        )


def _compile(model, optimizer, mode, **kwargs):
    model.compile(
        optimizer=optimizer,
        loss="mse",
        run_eagerly=mode == "eager" and BACKEND != "torch",
        jit_compile=mode in ("xla", "jit"),
        **kwargs,
    )
    return model


def _error_text(error):
    texts = []
    while error is not None:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def _multi_optimizer():
    """A `MultiOptimizer` of two accumulating optimizers: Adam for the first
    layer (called first), SGD with momentum for the last (its outputs are
    2 wide). (It refuses an AdaScale rate: its gain is the model's.)"""
    adam = ao.AdamAccumulate(
        learning_rate=0.05, accum_iters=ACCUM_ITERS, **NOISE
    )
    sgd = ao.SGDAccumulate(
        learning_rate=0.05,
        momentum=0.9,
        accum_iters=ACCUM_ITERS,
        **NOISE,
    )
    return keras.optimizers.MultiOptimizer(
        lambda variable: sgd if variable.shape[-1] == 2 else adam
    )


def _train_with_fault(point, at, mode, make_error, multi=False, callbacks=()):
    fault = Fault(make_error, at=at)
    model = model_with(
        forward=fault if point == "forward" else None,
        backward=fault if point == "backward" else None,
    )
    if multi:
        # Inside a loss scaler, as `compile` wraps it under mixed_float16
        # (its own step counter is Keras', outside the snapshot).
        optimizer = keras.optimizers.LossScaleOptimizer(_multi_optimizer())
    else:
        optimizer = ao.AdamAccumulate(
            learning_rate=ao.schedules.sqrt_scaling(0.05, base_batch_size=1),
            accum_iters=ACCUM_ITERS,
            **NOISE,
        )
    _compile(model, optimizer, mode)
    x, y, _ = data(Run(samples=SAMPLES))
    snapshot = Snapshot(accumulating)
    snapshot.take(model)  # a PyDataset may fail before training begins
    callbacks = [snapshot, *callbacks]
    if point == "callback":
        callbacks.append(FailingCallback(fault))
    dataset = FailingData(
        x, y, MICRO_BATCH, fault if point == "data" else Fault()
    )
    with patch_parent_update_step(
        keras.optimizers.Adam, fault if point == "update" else None
    ):
        with pytest.raises(Exception) as raised:
            model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)
    return fault, model, snapshot, raised.value


@pytest.mark.parametrize("point,at", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_an_error_in_a_micro_step_leaves_the_last_steps_state(
    mode, point, at, request
):
    _check_an_error_in_a_micro_step(mode, point, at, request, multi=False)


# Through a `MultiOptimizer` (its optimizers' variables are among its own):
# a pending window, the closing micro-step, and the first optimizer's close.
MULTI_CASES = [("forward", 1), ("backward", 2), ("update", 1)]


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
@pytest.mark.parametrize("point,at", MULTI_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_an_error_in_a_micro_step_leaves_every_inner_optimizers_state(
    mode, point, at, request
):
    _check_an_error_in_a_micro_step(mode, point, at, request, multi=True)


def _check_an_error_in_a_micro_step(mode, point, at, request, multi):
    if not (multi and point == "backward"):
        # Inside the loss scaler the update is a branch on every
        # gradient's finiteness: no sum is written before they all exist.
        _mark_known_hole(request, "step", (mode, point, at))
    if point in ("forward", "backward", "update") and not tap_supported(
        mode == "xla"
    ):
        pytest.skip("XLA runs no Python inside the step")
    writes_as_it_runs = mode == "graph" and point in ("backward", "update")
    # Where the step writes as it runs, the documented recovery is a
    # checkpoint: Keras' own, taken after every step.
    backup = (
        keras.callbacks.BackupAndRestore(
            str(request.getfixturevalue("tmp_path") / "backup"), save_freq=1
        )
        if writes_as_it_runs
        else None
    )
    fault, model, snapshot, error = _train_with_fault(
        point,
        at,
        mode,
        lambda: RuntimeError(f"{MESSAGE}: RuntimeError"),
        multi=multi,
        callbacks=[backup] if backup else [],
    )
    assert fault.raised == 1
    assert _noise_variables(snapshot.state), "the noise scale's variables"
    assert MESSAGE in _error_text(error), _error_text(error)
    if point == "update" and mode == "eager" and BACKEND != "jax":
        # The close had begun to write: it cannot be undone, and says so.
        # (A JAX step computes its state before `fit` takes it: none is.)
        assert PARTLY_WRITTEN in "\n".join(getattr(error, "__notes__", []))
        return
    try:
        after = state_of(model, accumulating(model))
    except RuntimeError as unreadable:
        # Keras' JAX `fit` donates the state to the compiled step: a step
        # that fails inside loses it, the parent's too (pinned below).
        assert mode == "jit" and "deleted" in str(unreadable), unreadable
        return
    changed = differences(after, snapshot.state)
    if writes_as_it_runs:
        _check_graph_writes(point, changed, model, snapshot, backup)
        return
    assert not changed, (
        f"after {snapshot.steps} steps, the failing one changed {changed}"
    )


def _check_graph_writes(point, changed, model, snapshot, backup):
    """What a TensorFlow graph step that raised may leave written, as
    docs/how-it-works.md says (no Python runs in it to note the error):
    from the backward pass, the sums of the gradients already computed (no
    counter, no weight); from the parent's update, part of the window's
    close (its `iterations` counted). Then Keras' `BackupAndRestore`,
    taken after every step, puts back the last step's state exactly."""
    if point == "backward":
        assert all(path.endswith("_accum_sum") for path in changed), changed
    else:
        assert any(path.endswith("/iteration") for path in changed), changed
    restored = keras.callbacks.BackupAndRestore(backup.backup_dir)
    restored.set_model(model)
    restored.on_train_begin()
    changed = differences(state_of(model, accumulating(model)), snapshot.state)
    assert not changed, f"restored after {snapshot.steps} steps: {changed}"


def _noise_variables(state):
    """The paths in a `state_of` of the noise scale's variables named for
    it (its sums, the last window's trace, the averages' weight...)."""
    return [path for path in state["optimizer"] if "noise" in path]


@pytest.mark.backends("jax")
def test_keras_own_jax_fit_loses_the_state_of_a_failed_compiled_step():
    # The reason JAX's compiled mode may end with the state unreadable:
    # the parent Keras optimizer does the same. If Keras starts keeping it,
    # require ours to keep it too (remove the exception above).
    fault = Fault(at=2)
    model = model_with(forward=fault)
    _compile(model, keras.optimizers.Adam(0.05), "jit")
    x, y, _ = data(Run(samples=SAMPLES))
    with pytest.raises(Exception, match=MESSAGE):
        model.fit(FailingData(x, y, MICRO_BATCH, Fault()), verbose=0)
    with pytest.raises(RuntimeError, match="deleted"):
        model.get_weights()


# -- fit_to_memory: out of memory at each point of a step ----------------------

MEMORY_RUN = MemoryRun(
    optimizer="adam", target=8, micro_batch=4, samples=20, epochs=1
)
# Steps of 4 samples, windows of 2 steps: forward/backward pass 1 is the
# first window's second (closing) step, 2 the second window's first; the
# parent's update pass 1 is inside the first close, 4 the second close's
# first variable.
MEMORY_CASES = [
    ("forward", 1),
    ("forward", 2),
    ("backward", 1),
    ("backward", 2),
    ("update", 0),
    ("update", 1),
    ("update", 4),
]
# No Python runs inside XLA on TensorFlow; JAX raises a compiled step's
# out-of-memory error before it runs, from the train function
# (`test_fit_to_memory.Injector` injects it there), not from inside it.
MEMORY_MODES = [m for m in MODES if m not in ("xla", "jit")]


def _fit_to_memory_with_fault(point, at, mode, callbacks=()):
    fault = Fault(out_of_memory_error, at=at)
    model = model_with(
        forward=fault if point == "forward" else None,
        backward=fault if point == "backward" else None,
    )
    _compile(model, ao.AdamAccumulate(learning_rate=0.02, **NOISE), mode)
    run = MEMORY_RUN
    x, y, _ = data(Run(samples=run.samples))
    with patch_parent_update_step(
        keras.optimizers.Adam, fault if point == "update" else None
    ):
        history = ao.fit_to_memory(
            model,
            x,
            y,
            target_batch_size=run.target,
            micro_batch_size=run.micro_batch,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )
    return fault, model, history


@pytest.mark.parametrize("point,at", MEMORY_CASES)
@pytest.mark.parametrize("mode", MEMORY_MODES)
def test_out_of_memory_in_a_step_is_recovered_to_the_parents_result(
    mode, point, at, request
):
    _mark_known_hole(request, "memory", (mode, point, at))
    if point == "update" and BACKEND != "jax":
        # Inside the window's close the step cannot be undone: training
        # stops, saying so, rather than retrying from a half-written state.
        # (A JAX step computes its state before `fit` takes it: it retries.)
        with pytest.raises(RuntimeError, match=CANNOT_RETRY):
            _fit_to_memory_with_fault(point, at, mode)
        return
    fault, model, history = _fit_to_memory_with_fault(point, at, mode)
    assert fault.raised == 1
    assert [size for *_, size in history.plan.recoveries] == [2]
    initial = model_with().get_weights()
    parent = train_parent_to_memory(MEMORY_RUN)
    assert_same_run(MEMORY_RUN, outcome(model), parent, initial)


@pytest.mark.parametrize("mode", MODES)
def test_out_of_memory_in_a_callback_ends_fit_to_memory_with_the_error(mode):
    fault = Fault(out_of_memory_error, at=1)
    snapshot = Snapshot(accumulating)
    with pytest.raises(Exception) as raised:
        _, model, _ = _fit_to_memory_with_fault(
            "none", None, mode, callbacks=[snapshot, FailingCallback(fault)]
        )
    assert MESSAGE in _error_text(raised.value)
    model = snapshot.model
    changed = differences(state_of(model, accumulating(model)), snapshot.state)
    assert not changed, changed


def test_an_out_of_memory_recovery_after_a_skip_stops_naming_it():
    # Sample 0 is NaN, so micro-batch 0 is skipped and the window spills
    # past its target batch; the error comes at the next step (sample 4),
    # mid-window, which cannot be re-cut exactly: training stops, the state
    # as before the failed step.
    from test_fit_to_memory import Injector

    x, y, _ = data(Run(samples=24))
    x[0, 0] = np.nan
    model = model_with()
    optimizer = ao.AdamAccumulate(0.01, skip_nonfinite=True, **NOISE)
    _compile(model, optimizer, "eager" if BACKEND == "torch" else "graph")
    Injector(model, [(1, 2)])
    with pytest.raises(RuntimeError, match="regrouped"):
        ao.fit_to_memory(
            model,
            x,
            y,
            target_batch_size=12,
            micro_batch_size=4,
            shuffle=False,
            verbose=0,
        )
    ended = outcome(model)
    assert ended["skipped"] == 1 and ended["iterations"] == 0
    assert int(keras.ops.convert_to_numpy(optimizer.micro_steps)) == 0


# -- A call with a bad argument ----------------------------------------------

BAD_ARGUMENTS = {
    "loss=str": {"loss": "high"},
    "loss=vector": {"loss": np.ones(3, "float32")},
    "weight=-1": {"weight": -1.0},
    "weight=nan": {"weight": float("nan")},
}


@pytest.mark.parametrize("bad", sorted(BAD_ARGUMENTS))
def test_a_call_with_a_bad_argument_raises_and_changes_nothing(bad, request):
    variables = [keras.Variable(np.ones(3, "float32"))]
    optimizer = ao.AdamAccumulate(0.1, accum_iters=3, **NOISE)
    optimizer.build(variables)
    grads = [keras.ops.ones(3)]
    optimizer.apply(grads, variables, weight=2.0, loss=1.0)
    before = {
        v.path: np.array(keras.ops.convert_to_numpy(v.value))
        for v in optimizer.variables
    }
    with pytest.raises((TypeError, ValueError)):
        optimizer.apply(
            grads, variables, **dict({"weight": 2.0}, **BAD_ARGUMENTS[bad])
        )
    changed = [
        v.path
        for v in optimizer.variables
        if not np.array_equal(
            keras.ops.convert_to_numpy(v.value), before[v.path], equal_nan=True
        )
    ]
    assert not changed, changed


# -- A gradient that passes the shape check and cannot be added ---------------

SHAPES = [(3,), (4, 3)]  # a bias, then a table: the bad gradient is the 2nd's


def _bad_gradient(kind):
    """A gradient for a (4, 3) variable, of the right shape, that the
    window's sum cannot take."""
    if kind == "string":
        return np.full((4, 3), "a")
    if kind == "int32":
        return np.ones((4, 3), "int32")
    import tensorflow as tf

    # Rows 1 and 4 of a 4-row variable: the scatter would write row 1.
    return tf.IndexedSlices(
        tf.ones((2, 3)), tf.constant([1, 4]), tf.constant([4, 3])
    )


BAD_GRADIENTS = {
    "string": "dtype str",
    "int32": "dtype int32",
    **(
        {"IndexedSlices-out-of-range": r"indices must be in \[0, 4\)"}
        if BACKEND == "tensorflow"
        else {}
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_GRADIENTS))
def test_a_call_with_a_bad_gradient_raises_and_changes_nothing(kind):
    # Windows of 3; the refused call comes with one micro-batch pending,
    # and the window then closes with the next two, exactly like the parent
    # on the window's mean.
    ours_vars = random_variables(5, SHAPES)
    parent_vars = random_variables(5, SHAPES)
    rng = np.random.default_rng(6)
    window = [
        [rng.normal(size=s).astype("float32") for s in SHAPES] for _ in range(3)
    ]
    optimizer = ao.AdamAccumulate(0.1, accum_iters=3, **NOISE)
    optimizer.apply(window[0], ours_vars, loss=1.0)
    before = to_numpy(optimizer.variables + ours_vars)
    with pytest.raises(ValueError, match=BAD_GRADIENTS[kind]) as raised:
        optimizer.apply([window[1][0], _bad_gradient(kind)], ours_vars)
    assert ours_vars[1].path in str(raised.value)
    after = to_numpy(optimizer.variables + ours_vars)
    changed = [
        v.path
        for v, a, b in zip(optimizer.variables + ours_vars, after, before)
        if not np.array_equal(a, b, equal_nan=True)
    ]
    assert not changed, changed
    for grads in window[1:]:
        optimizer.apply(grads, ours_vars, loss=1.0)
    parent_on_window_means(keras.optimizers.Adam(0.1), parent_vars, [window])
    assert int(optimizer.iterations) == 1
    assert_all_close(ours_vars, parent_vars, rtol=1e-6, atol=1e-7)


def _named_variables(seed):
    rng = np.random.default_rng(seed)
    return [
        keras.Variable(rng.normal(size=shape).astype("float32"), name=name)
        for name, shape in zip(("bias", "table"), SHAPES)
    ]


def _multi(sgd, adam):
    """SGD for the bias (the map's, applied first), Adam for the table."""
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(adam, {"bias": sgd})
    )


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
@pytest.mark.parametrize("kind", ["shape", "string"])
def test_a_multi_optimizer_call_that_raises_changes_no_inner_optimizer(kind):
    # Windows of 2, one micro-batch pending: the SGD's call would close its
    # window before the Adam's gradient is refused, leaving the two windows
    # a micro-batch apart from then on.
    ours_vars, parent_vars = _named_variables(7), _named_variables(7)
    rng = np.random.default_rng(8)
    windows = [
        [[rng.normal(size=s).astype("float32") for s in SHAPES] for _ in "ab"]
        for _ in range(2)
    ]
    optimizer = _multi(
        ao.SGDAccumulate(0.1, momentum=0.9, accum_iters=2, **NOISE),
        ao.AdamAccumulate(0.1, accum_iters=2, **NOISE),
    )
    optimizer.apply(windows[0][0], ours_vars)
    before = to_numpy(optimizer.variables + ours_vars)
    bad = np.ones((3, 4), "float32") if kind == "shape" else _bad_gradient(kind)
    with pytest.raises(ValueError, match=ours_vars[1].path):
        optimizer.apply([windows[0][1][0], bad], ours_vars)
    changed = [
        v.path
        for v, a, b in zip(
            optimizer.variables + ours_vars,
            to_numpy(optimizer.variables + ours_vars),
            before,
        )
        if not np.array_equal(a, b, equal_nan=True)
    ]
    assert not changed, changed
    for grads in windows[0][1:] + windows[1]:
        optimizer.apply(grads, ours_vars)
    parent = _multi(
        keras.optimizers.SGD(0.1, momentum=0.9), keras.optimizers.Adam(0.1)
    )
    parent_on_window_means(parent, parent_vars, windows)
    assert [int(o.iterations) for o in optimizer.optimizers] == [2, 2]
    assert_all_close(ours_vars, parent_vars, rtol=1e-6, atol=1e-7)


# -- A negative normalizer at each micro-step of a window ---------------------


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_a_negative_normalizer_anywhere_in_a_window_changes_no_weight(
    mode, position, request
):
    # Windows of 3 micro-batches of 4; the micro-batch at `position` of the
    # first window has sample weights summing to -5 under
    # `mean_with_sample_weight`. Eagerly the step is refused, naming the
    # normalizer; compiled JAX and XLA code cannot raise: the loss is NaN
    # and `TerminateOnNaN` stops training. Either way no weight moves.
    x, y, _ = data(Run(samples=12))
    weights = np.ones(12, "float32")
    weights[4 * position : 4 * position + 3] = -2.0
    model = model_with()
    model.compile(
        optimizer=ao.AdamAccumulate(0.05, accum_iters=3, **NOISE),
        loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
        run_eagerly=mode == "eager" and BACKEND != "torch",
        jit_compile=mode in ("xla", "jit"),
    )
    ao.weigh_micro_batches(model)
    before = model.get_weights()
    try:
        model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=4,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.TerminateOnNaN()],
        )
    except Exception as error:
        assert "normalizer" in _error_text(error)
        if BACKEND == "jax":
            return  # JAX's `fit` leaves no values after a failure
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
