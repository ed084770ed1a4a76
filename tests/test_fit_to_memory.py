"""`fit_to_memory` and `plan_micro_batch`: the micro-batch planned against
a memory limit (JAX's memory analysis), found by out-of-memory probes, and
recovered from an out-of-memory error mid-epoch, on every backend.

Out-of-memory errors are injected: the train step raises the backend's own
error type (TensorFlow's `ResourceExhaustedError`, from inside the compiled
step; JAX's `JaxRuntimeError` with `RESOURCE_EXHAUSTED`, from the compiled
train function; torch's `OutOfMemoryError`) when its micro-batch is larger
than a size. The oracle is the parent Keras optimizer trained with
`batch_size=target` on the same data order.
"""

import keras
import numpy as np
import pytest
from helpers import assert_same_weights
from helpers import fit_in_order
from helpers import regression_data
from helpers import sample_weights
from helpers import small_model
from helpers import to_numpy
from helpers import window_state

from accum_optimizers import AccumBatchNormalization
from accum_optimizers import AdamAccumulate
from accum_optimizers import MicroBatchPlan
from accum_optimizers import fit_to_memory
from accum_optimizers import plan_micro_batch
from accum_optimizers._backend import is_out_of_memory

BACKEND = keras.backend.backend()


def out_of_memory_error():
    """The error the backend raises when a step runs out of device memory."""
    message = "Out of memory while trying to allocate 1.00GiB (injected)"
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.errors.ResourceExhaustedError(None, None, message)
    if BACKEND == "jax":
        import jax

        return jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: {message}")
    import torch

    return torch.OutOfMemoryError(f"CUDA out of memory. {message}")


class Injector:
    """Makes `model`'s train step run out of memory: from its call number
    `from_call` on (counting every call, probes included), a micro-batch
    of more than `above` samples raises the backend's error.

    Args:
        model: a compiled model; for `in_backward`, one built by
            `tapped_model`.
        rules: `(from_call, above)` pairs; any rule that matches raises.
        error: `None` for the out-of-memory error, or a function making
            another error to raise instead.
        in_backward: raise in the middle of the backward pass, once the
            last layer's gradients exist (its `BackwardTap`), instead of
            before the step (TensorFlow outside XLA, and torch).
    """

    def __init__(self, model, rules, error=None, in_backward=False):
        self.rules = list(rules)
        self.calls = 0
        self.raised = 0
        self.error = error or out_of_memory_error
        if in_backward:
            taps = [layer for layer in model.layers if hasattr(layer, "tap")]
            assert taps and BACKEND != "jax", "a tapped_model, not JAX"
            taps[0].tap = self.tap
        elif BACKEND == "jax":
            self._wrap_jax_train_function(model)
        else:
            self._wrap_train_step(model)

    def tap(self, upstream):
        """`upstream`, a gradient in the backward pass, after the check of
        its micro-batch's size."""
        if BACKEND == "tensorflow":
            import tensorflow as tf

            if not tf.executing_eagerly():

                def check(size):
                    if self.check(int(size)):
                        raise MemoryError("OOM in the backward (injected)")
                    return 0

                size = tf.shape(upstream)[0]
                token = tf.py_function(check, [size], tf.int32)
                with tf.control_dependencies([token]):
                    return tf.identity(upstream)
        if self.check(int(upstream.shape[0])):
            raise self.error()
        return upstream

    def check(self, size):
        call = self.calls
        self.calls += 1
        if any(call >= start and size > above for start, above in self.rules):
            self.raised += 1
            return True
        return False

    def _wrap_train_step(self, model):
        train_step = model.train_step

        if BACKEND == "tensorflow":
            import tensorflow as tf

            def check(size):
                if self.check(int(size)):
                    # `tf.py_function` raises a Python `MemoryError` as
                    # `ResourceExhaustedError`, TensorFlow's out-of-memory.
                    raise MemoryError("OOM when allocating tensor (injected)")
                return 0

            def injected(data):
                size = tf.shape(keras.tree.flatten(data[0])[0])[0]
                token = tf.py_function(check, [size], tf.int32)
                with tf.control_dependencies([token]):
                    data = keras.tree.map_structure(
                        lambda t: None if t is None else tf.identity(t), data
                    )
                return train_step(data)

        else:

            def injected(data):
                if self.check(len(keras.tree.flatten(data[0])[0])):
                    raise self.error()
                return train_step(data)

        model.train_step = injected

    def _wrap_jax_train_function(self, model):
        # Outside the compiled step, where JAX raises a compiled step's
        # runtime errors; after `fit` took the state off the variables.
        make_train_function = model.make_train_function

        def make(force=False):
            make_train_function(force)
            compiled = model.train_function
            if getattr(compiled, "injected", False):
                return compiled

            def injected(state, iterator):
                data = next(iterator)
                if self.check(len(keras.tree.flatten(data[0])[0])):
                    raise self.error()
                return compiled(state, iter([data]))

            injected.injected = True
            model.train_function = injected
            return injected

        model.make_train_function = make


class BackwardTap(keras.layers.Layer):
    """The identity, whose gradient goes through `tap` (set by an
    `Injector`) in training."""

    def call(self, x, training=False):
        if not training:
            return x

        @keras.ops.custom_gradient
        def identity(x):
            def grad(*args, upstream=None):
                return self.tap(args[0] if upstream is None else upstream)

            return x, grad

        return identity(x)

    def tap(self, upstream):
        return upstream


def tapped_model(model):
    """`model` (a `Sequential` of two layers) with a `BackwardTap` between
    its layers, and its weights."""
    first, last = model.layers
    tapped = keras.Sequential(
        [
            keras.Input(model.inputs[0].shape[1:]),
            type(first).from_config(first.get_config()),
            BackwardTap(),
            type(last).from_config(last.get_config()),
        ]
    )
    tapped.set_weights(model.get_weights())
    return tapped


def compiled(model, optimizer, jit_compile="auto"):
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    return model


def parent_run(x, y, target, epochs, sample_weight=None, orders=None):
    """The oracle: Adam at `batch_size=target`, each epoch in its order."""
    model = compiled(small_model(0), keras.optimizers.Adam(0.01))
    for epoch in range(epochs):
        order = np.arange(len(x)) if orders is None else orders[epoch]
        weights = None if sample_weight is None else sample_weight[order]
        fit_in_order(
            model, x[order], y[order], sample_weight=weights, batch_size=target
        )
    return model


def assert_trains_like_parent(model, x, y, target, epochs=1, **order):
    """`model`'s weights are the oracle's (`parent_run`); returns it."""
    parent = parent_run(x, y, target, epochs, **order)
    assert_same_weights(model, parent, rtol=1e-5, atol=1e-6)
    return parent


def ours(jit_compile="auto"):
    return compiled(small_model(0), AdamAccumulate(0.01), jit_compile)


# -- Probes -----------------------------------------------------------------


def test_probes_find_the_largest_micro_batch_that_fits_and_train_exactly():
    x, y = regression_data(1, 45)
    model = ours()
    injector = Injector(model, [(0, 5)])
    history = fit_to_memory(
        model, x, y, target_batch_size=14, epochs=2, shuffle=False, verbose=0
    )
    plan = history.plan
    # Window sizes 1, 2, 4 (micro-batches 14, 7, 4), then 3 (5): the
    # largest micro-batch of at most 5 samples, its window's last one 4.
    assert [size for size, _, _ in plan.probes] == [14, 7, 4, 5]
    assert [fits for _, fits, _ in plan.probes] == [False, False, True, True]
    assert (plan.micro_batch_size, plan.accum_iters) == (5, 3)
    assert plan.method == "out_of_memory_probes"
    assert plan.recoveries == []
    assert injector.raised == 2
    assert len(history.history["loss"]) == 2
    assert_trains_like_parent(model, x, y, 14, epochs=2)


def test_probes_leave_weights_and_optimizer_state_as_they_were():
    x, y = regression_data(2, 32)
    model = ours()
    Injector(model, [(0, 3)])
    plan = plan_micro_batch(model, x, y, target_batch_size=16)
    assert isinstance(plan, MicroBatchPlan)
    assert (plan.micro_batch_size, model.optimizer.accum_iters) == (3, 6)
    for a, b in zip(model.get_weights(), small_model(0).get_weights()):
        np.testing.assert_array_equal(a, b)
    optimizer = model.optimizer
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 0
    assert int(keras.ops.convert_to_numpy(optimizer.micro_steps)) == 0
    assert float(to_numpy(window_state(optimizer)["total_weight"])) == 0.0
    for variable in optimizer.variables:
        if not variable.path.endswith("learning_rate"):
            assert not np.any(to_numpy(variable)), variable.path


def test_a_micro_batch_of_one_that_does_not_fit_raises():
    x, y = regression_data(3, 8)
    model = ours()
    Injector(model, [(0, 0)])
    with pytest.raises(MemoryError, match="not even a micro-batch of 1"):
        plan_micro_batch(model, x, y, target_batch_size=4)


# -- Recovery ---------------------------------------------------------------


@pytest.mark.parametrize(
    "in_backward",
    [
        False,
        # Once the last layer's gradients exist: a TensorFlow graph may
        # have added them into the window's sums, and the window starts
        # again from its first sample.
        pytest.param(True, marks=pytest.mark.backends("tensorflow", "torch")),
    ],
)
def test_out_of_memory_mid_epoch_halves_the_micro_batch_and_stays_exact(
    in_backward,
):
    x, y = regression_data(4, 40)
    weights = sample_weights(4, 40)
    model = small_model(0)
    if in_backward:
        model = tapped_model(model)
    # The tap's `tf.py_function` does not compile under XLA.
    jit_compile = False if in_backward else "auto"
    model = compiled(model, AdamAccumulate(0.01), jit_compile)
    # 6 -> 3 mid-window (calls 0-4 are micro-batches of 6; call 5, from
    # sample 30, is the second of window 3), then 3 -> 2 mid-window in the
    # second epoch: odd halving, a window of 12 cut 2, 2, ... after
    # micro-batches of 3.
    injector = Injector(model, [(5, 3), (17, 2)], in_backward=in_backward)
    history = fit_to_memory(
        model,
        x,
        y,
        sample_weight=weights,
        target_batch_size=12,
        micro_batch_size=6,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    plan = history.plan
    assert [(e, size, new) for e, _, size, new in plan.recoveries] == [
        (0, 6, 3),
        (1, 3, 2),
    ]
    assert plan.recoveries[0][1] == 30
    assert (plan.micro_batch_size, model.optimizer.accum_iters) == (2, 6)
    assert injector.raised == 2
    assert history.epoch == [0, 1]
    parent = assert_trains_like_parent(
        model, x, y, 12, epochs=2, sample_weight=weights
    )
    assert int(to_numpy(model.optimizer.iterations)) == int(
        to_numpy(parent.optimizer.iterations)
    )


def test_recovery_keeps_each_epochs_shuffled_order():
    x, y = regression_data(5, 30)
    model = ours()
    Injector(model, [(7, 4)])
    fit_to_memory(
        model,
        x,
        y,
        target_batch_size=8,
        micro_batch_size=8,
        epochs=3,
        seed=7,
        verbose=0,
    )
    # The documented order: a permutation drawn from `[seed, epoch]`.
    orders = [np.random.default_rng([7, e]).permutation(30) for e in range(3)]
    assert_trains_like_parent(model, x, y, 8, epochs=3, orders=orders)


@pytest.mark.parametrize(
    "seed, samples, rules, plan, epochs, probes, recoveries",
    [
        # The first step of each `fit` (JAX: after `fit` took the state off
        # the variables) fails, twice.
        pytest.param(
            6,
            16,
            [(0, 4)],
            dict(target_batch_size=16, micro_batch_size=16),
            1,
            [],
            [(0, 0, 16, 8), (0, 0, 8, 4)],
            id="the_first_step_of_a_fit",
        ),
        # Probes (calls 0-3: micro-batches 14, 7, 4, 5) leave a trained
        # state behind them in Keras' JAX trainer; the first training step
        # (call 4) fails.
        pytest.param(
            11,
            45,
            [(0, 5), (4, 3)],
            dict(target_batch_size=14),
            1,
            [14, 7, 4, 5],
            [(0, 0, 5, 3)],
            id="the_first_step_after_probes",
        ),
        # 21 samples, windows of 14 and 7: epoch 0's last window (call 2) is
        # applied by the epoch's flush; epoch 1's first step (call 3) fails.
        pytest.param(
            12,
            21,
            [(3, 4)],
            dict(target_batch_size=14, micro_batch_size=7),
            2,
            [],
            [(1, 0, 7, 4)],
            id="an_epochs_first_step_after_a_flush",
        ),
    ],
)
def test_out_of_memory_on_a_first_step_keeps_the_state(
    seed, samples, rules, plan, epochs, probes, recoveries
):
    x, y = regression_data(seed, samples)
    model = ours()
    Injector(model, rules)
    history = fit_to_memory(
        model, x, y, **plan, epochs=epochs, shuffle=False, verbose=0
    )
    assert [size for size, _, _ in history.plan.probes] == probes
    assert history.plan.recoveries == recoveries
    assert_trains_like_parent(model, x, y, plan["target_batch_size"], epochs)


def test_validation_and_a_users_flush_callback_survive_a_recovery():
    from accum_optimizers import FlushAccumulation

    x, y = regression_data(13, 24)
    model = ours()
    Injector(model, [(3, 4)])
    history = fit_to_memory(
        model,
        x,
        y,
        target_batch_size=8,
        micro_batch_size=8,
        epochs=2,
        shuffle=False,
        callbacks=[FlushAccumulation()],
        validation_data=(x[:8], y[:8]),
        verbose=0,
    )
    assert history.epoch == [0, 1]
    assert len(history.history["val_loss"]) == 2
    parent = assert_trains_like_parent(model, x, y, 8, epochs=2)
    np.testing.assert_allclose(
        history.history["val_loss"][-1],
        parent.evaluate(x[:8], y[:8], verbose=0),
        rtol=1e-5,
    )


def test_inputs_may_be_dicts_of_arrays():
    x, y = regression_data(14, 20)
    inputs = keras.Input((4,), name="features")
    keras.utils.set_random_seed(0)
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model({"features": inputs}, keras.layers.Dense(2)(hidden))
    model.compile(optimizer=AdamAccumulate(0.01), loss="mse")
    Injector(model, [(0, 4)])
    history = fit_to_memory(
        model,
        {"features": x},
        y,
        target_batch_size=10,
        shuffle=False,
        verbose=0,
    )
    assert history.plan.micro_batch_size == 4
    assert_trains_like_parent(model, x, y, 10)


def test_other_errors_propagate_unchanged():
    x, y = regression_data(7, 16)
    model = ours()
    if BACKEND == "tensorflow":
        pytest.skip("the injector raises only out-of-memory errors on TF")
    Injector(model, [(1, 4)], error=lambda: ValueError("not memory"))
    with pytest.raises(ValueError, match="not memory"):
        fit_to_memory(
            model,
            x,
            y,
            target_batch_size=8,
            micro_batch_size=8,
            verbose=0,
        )


def test_only_the_backends_out_of_memory_error_counts():
    assert is_out_of_memory(out_of_memory_error())
    assert not is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED"))
    assert not is_out_of_memory(MemoryError("host"))
    if BACKEND == "jax":
        import jax

        other = jax.errors.JaxRuntimeError("INTERNAL: something else")
        assert not is_out_of_memory(other)


# -- The memory-analysis planner (JAX) ------------------------------------


def _wide_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(4),
        ]
    )


def _compiled_step_peak(model, size):
    """The test's own measure: XLA's memory analysis of Keras' train step
    at micro-batch `size`, compiled with the state donated."""
    import jax

    state = tuple(
        [v.value for v in group]
        for group in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    data = (
        jax.ShapeDtypeStruct((size, 64), "float32"),
        jax.ShapeDtypeStruct((size, 4), "float32"),
        None,
    )
    compiled_step = (
        jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile()
    )
    m = compiled_step.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


@pytest.mark.backends("jax")
def test_memory_limit_plans_the_largest_micro_batch_whose_step_fits():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype("float32")
    y = rng.normal(size=(256, 4)).astype("float32")
    model = compiled(_wide_model(), AdamAccumulate(1e-3))
    plan_micro_batch(model, x, y, target_batch_size=256, micro_batch_size=256)
    peaks = {size: _compiled_step_peak(model, size) for size in (128, 86)}
    # A limit between the steps of 86 (3 windows) and 128 (2 windows).
    limit = (peaks[128] + peaks[86]) // 2
    assert peaks[86] < limit < peaks[128]
    plan = plan_micro_batch(
        model, x, y, target_batch_size=256, memory_limit=limit
    )
    assert (plan.micro_batch_size, plan.accum_iters) == (86, 3)
    assert plan.method == "memory_analysis"
    assert plan.peak_bytes <= limit
    assert plan.memory_limit == limit
    assert {size for size, fits, _ in plan.probes if not fits} >= {128}


@pytest.mark.backends("jax")
def test_training_at_the_planned_micro_batch_equals_the_parent():
    x, y = regression_data(8, 40)
    model = ours()
    # A byte less than the whole target's step needs (on a model this small
    # a window's sums can outweigh a larger batch, so the limit is set by
    # the target itself).
    limit = (
        plan_micro_batch(
            model, x, y, target_batch_size=10, micro_batch_size=10
        ).peak_bytes
        - 1
    )
    history = fit_to_memory(
        model,
        x,
        y,
        target_batch_size=10,
        memory_limit=limit,
        shuffle=False,
        verbose=0,
    )
    assert history.plan.peak_bytes <= limit
    assert history.plan.micro_batch_size < 10
    assert_trains_like_parent(model, x, y, 10)


@pytest.mark.backends("tensorflow", "torch")
def test_memory_limit_is_refused_where_no_memory_analysis_exists():
    x, y = regression_data(9, 8)
    with pytest.raises(ValueError, match="memory_limit=1000000"):
        plan_micro_batch(
            ours(), x, y, target_batch_size=4, memory_limit=1_000_000
        )


# -- Bad input --------------------------------------------------------------


@pytest.mark.parametrize("target", [0, -3, 2.5, True, "8"])
def test_a_bad_target_batch_size_is_refused_by_name(target):
    x, y = regression_data(10, 8)
    with pytest.raises((TypeError, ValueError), match="target_batch_size="):
        plan_micro_batch(ours(), x, y, target_batch_size=target)


@pytest.mark.parametrize("limit", [0, -5, "lots", float("nan"), "12 parsecs"])
def test_a_bad_memory_limit_is_refused_by_name(limit):
    x, y = regression_data(10, 8)
    with pytest.raises(ValueError, match="memory_limit="):
        plan_micro_batch(ours(), x, y, target_batch_size=4, memory_limit=limit)


def test_memory_limit_strings_carry_units():
    from accum_optimizers._memory import memory_limit_bytes

    assert memory_limit_bytes("2GiB") == 2 * 2**30
    assert memory_limit_bytes("500 MB") == 500 * 10**6
    assert memory_limit_bytes(1234) == 1234


def test_a_micro_batch_larger_than_the_target_is_refused():
    x, y = regression_data(10, 8)
    with pytest.raises(ValueError, match="micro_batch_size=8"):
        plan_micro_batch(ours(), x, y, target_batch_size=4, micro_batch_size=8)


def test_a_non_accumulating_optimizer_is_refused():
    x, y = regression_data(10, 8)
    model = compiled(small_model(0), keras.optimizers.Adam())
    with pytest.raises(ValueError, match="accumulating optimizer"):
        fit_to_memory(model, x, y, target_batch_size=4, verbose=0)


def test_an_accum_iters_schedule_is_refused():
    x, y = regression_data(10, 8)
    model = compiled(small_model(0), AdamAccumulate(accum_iters={0: 2, 3: 4}))
    with pytest.raises(ValueError, match="accum_iters="):
        fit_to_memory(model, x, y, target_batch_size=4, verbose=0)


def test_an_optimizer_built_without_window_state_is_refused():
    x, y = regression_data(10, 8)
    model = ours()
    model.optimizer.build(model.trainable_variables)  # accum_iters=1
    with pytest.raises(ValueError, match="accum_iters=1"):
        fit_to_memory(model, x, y, target_batch_size=4, verbose=0)


def test_accum_batch_normalization_is_refused_naming_the_layer():
    # The layer counts its own window in the forward pass: fit_to_memory's
    # window, and a micro-batch run again after a recovery, would not be
    # its.
    x, y = regression_data(10, 8)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            AccumBatchNormalization(accum_iters=2, name="bn"),
            keras.layers.Dense(2),
        ]
    )
    model = compiled(model, AdamAccumulate(accum_iters=2))
    weights = model.get_weights()
    with pytest.raises(ValueError, match="'bn' \\(accum_iters=2\\)"):
        fit_to_memory(model, x, y, target_batch_size=4, verbose=0)
    with pytest.raises(ValueError, match="'bn' \\(accum_iters=2\\)"):
        plan_micro_batch(model, x, y, target_batch_size=4)
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(after, before)


def test_inputs_other_than_arrays_are_refused_by_type():
    x, y = regression_data(10, 8)
    with pytest.raises(TypeError, match="x of type generator"):
        fit_to_memory(ours(), (b for b in x), y, target_batch_size=4, verbose=0)


def test_steps_per_execution_above_one_is_refused():
    x, y = regression_data(10, 8)
    model = small_model(0)
    model.compile(
        optimizer=AdamAccumulate(0.01), loss="mse", steps_per_execution=2
    )
    with pytest.raises(ValueError, match="steps_per_execution=2"):
        fit_to_memory(model, x, y, target_batch_size=4, verbose=0)


# -- The guide ------------------------------------------------------------


@pytest.mark.backends("jax")
def test_the_guides_example_prints_what_the_guide_shows():
    import contextlib
    import io
    import re
    from pathlib import Path

    page = (
        Path(__file__).resolve().parent.parent / "docs" / "fit-to-memory.md"
    ).read_text()
    title = "fit_to_memory against a memory limit"
    code = re.search(
        r'```python title="' + title + r'"\n(.*?)```', page, re.S
    ).group(1)
    shown = re.search(r"Its output .*?\n\n```text\n(.*?)```", page, re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "fit-to-memory.md", "exec"), {})
    printed = out.getvalue().splitlines()
    expected = shown.group(1).splitlines()
    # The plan and the probes' sizes and verdicts exactly; the peaks,
    # losses and the round-off to the parent are those of this XLA.
    assert printed[0].split(" (peak")[0] == expected[0].split(" (peak")[0]
    assert [line.split(":")[0] for line in printed[1:7]] == [
        line.split(":")[0] for line in expected[1:7]
    ]
    assert [line[-5:] for line in printed[1:7]] == [
        line[-5:] for line in expected[1:7]
    ]
    difference = float(printed[-1].rsplit(" ", 1)[1])
    assert difference < 1e-5


@pytest.mark.backends("torch")
def test_the_gpu_check_runs_and_matches_the_parent(capsys):
    # On the CPU nothing runs out of memory: the smoke run starts from a
    # micro-batch of 24 for a target of 64 (windows of 24, 24, 16).
    from benchmarks import fit_to_memory_gpu

    (row,) = fit_to_memory_gpu.main(["--smoke", "--backends", "torch"])
    assert (row["ours"]["micro_batch_size"], row["ours"]["accum_iters"]) == (
        24,
        3,
    )
    assert row["max_abs_difference"] < 1e-5
    assert "largest weight difference" in capsys.readouterr().out
