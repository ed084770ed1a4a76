"""Every execution mode Keras offers on the current backend: `jit_compile`
True / False / "auto", `run_eagerly=True`, and hand-written compiled loops
(`tf.function`; `jax.jit` around `stateless_apply`).

The oracle, the parent Keras optimizer on the big batch, trains in Keras'
default mode; ours trains in the mode under test."""

import keras
import numpy as np
import pytest
from helpers import PARENTS
from helpers import assert_same_state
from helpers import regression_data
from helpers import small_model
from loops import compiled_step
from loops import train_in_batches

from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate

K, B, WINDOWS = 3, 2, 3
OPTIONS = {
    "AdamAccumulate": dict(
        amsgrad=True,
        learning_rate=keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.7),
        use_ema=True,
        ema_overwrite_frequency=2,
    ),
    "SGDAccumulate": dict(momentum=0.9, nesterov=True, clipnorm=0.1),
    "RMSpropAccumulate": dict(centered=True, weight_decay=0.1),
}

# The modes that run different code on this backend, each under one name.
# Keras' `compile` resolves "auto" to False on torch and on a CPU-only
# TensorFlow, and to True on JAX; on JAX and torch `jit_compile=False` runs
# the step as `run_eagerly=True` does (torch compiles only with True).
MODES = [
    pytest.param(dict(jit_compile=True), id="jit_compile=True"),
    pytest.param(dict(jit_compile=False), id="jit_compile=False"),
    pytest.param(dict(jit_compile="auto"), id="jit_compile=auto"),
    pytest.param(dict(run_eagerly=True), id="run_eagerly=True"),
]
DISTINCT = {
    "tensorflow": ["jit_compile=True", "jit_compile=False", "run_eagerly=True"],
    "jax": ["jit_compile=auto", "run_eagerly=True"],
    "torch": ["jit_compile=True", "jit_compile=auto"],
}[keras.backend.backend()]
MODES = [mode for mode in MODES if mode.id in DISTINCT]


def _cases(cases):
    """Each of `cases` (`pytest.param`s) in each of `MODES`, but on torch
    `torch.compile` (`jit_compile=True`) only for the first case: it
    traces each model for tens of seconds, and the cases differ in the
    parent's update, which is Keras' code under every mode."""
    torch = keras.backend.backend() == "torch"
    return [
        pytest.param(*case.values, mode.values[0], id=f"{case.id}-{mode.id}")
        for mode in MODES
        for n, case in enumerate(cases)
        if not (torch and n > 0 and mode.id == "jit_compile=True")
    ]


@pytest.mark.parametrize(
    "cls, mode",
    _cases([pytest.param(cls, id=cls.__name__) for cls in PARENTS]),
)
def test_fit_in_every_execution_mode_equals_parent_big_batch(cls, mode):
    options = OPTIONS[cls.__name__]
    x, y = regression_data(9, WINDOWS * K * B + B)  # one window left partial
    parent_model = small_model(9)
    parent = PARENTS[cls](**options)
    parent_model.compile(optimizer=parent, loss="mse")
    parent_model.fit(x, y, batch_size=K * B, shuffle=False, verbose=0)

    our_model = small_model(9)
    ours = cls(accum_iters=K, **options)
    our_model.compile(optimizer=ours, loss="mse", **mode)
    our_model.fit(
        x,
        y,
        batch_size=B,
        shuffle=False,
        verbose=0,
        callbacks=[FlushAccumulation()],
    )
    assert int(ours.iterations) == WINDOWS + 1
    assert_same_state(ours, parent_model, our_model, parent)


VOCABULARY, UNUSED = 40, 4  # the last UNUSED tokens never occur


def _embedding_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(VOCABULARY, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )


def _tokens(rng, repeat):
    """WINDOWS windows of K * B samples of 3 tokens; with `repeat=False` no
    token occurs twice within a window."""
    used = VOCABULARY - UNUSED
    if repeat:
        return rng.integers(0, used, size=(WINDOWS * K * B, 3))
    return np.concatenate(
        [
            rng.permutation(used)[: K * B * 3].reshape(K * B, 3)
            for _ in range(WINDOWS)
        ]
    )


@pytest.mark.parametrize(
    "parent_cls, options, repeat, features, mode",
    _cases(
        [
            # The features read the gradients too: an `IndexedSlices`'
            # merged rows have a shape known only at run time (under XLA
            # as well).
            pytest.param(
                keras.optimizers.SGD,
                dict(momentum=0.9, nesterov=True),
                True,
                dict(skip_nonfinite=True, measure_noise_scale=True),
                id="SGD-repeated-tokens-skip-noise-scale",
            ),
            # On TensorFlow, Keras' Adam squares an `IndexedSlices`
            # gradient slice by slice, so with a token repeated in the big
            # batch its second moment is not that of the summed gradient,
            # which is what the window's mean is (docs/how-it-works.md).
            # Unique tokens here.
            pytest.param(
                keras.optimizers.Adam,
                dict(amsgrad=True),
                False,
                {},
                id="Adam-unique-tokens",
            ),
        ]
    ),
)
def test_sparse_embedding_gradients_equal_parent_big_batch(
    parent_cls, options, repeat, features, mode
):
    """An `Embedding` gets `tf.IndexedSlices` gradients on TensorFlow: added
    by scatter, overwritten on a window's first micro-step, and summed with
    the accumulator on its last. Rows of tokens that never occur must not
    move."""
    rng = np.random.default_rng(11)
    tokens = _tokens(rng, repeat).astype("int32")
    y = rng.normal(size=(len(tokens), 2)).astype("float32")
    parent_model = _embedding_model(11)
    parent = parent_cls(learning_rate=0.05, **options)
    parent_model.compile(optimizer=parent, loss="mse")
    parent_model.fit(tokens, y, batch_size=K * B, shuffle=False, verbose=0)

    our_model = _embedding_model(11)
    ours = {
        keras.optimizers.SGD: SGDAccumulate,
        keras.optimizers.Adam: AdamAccumulate,
    }[parent_cls](learning_rate=0.05, accum_iters=K, **options, **features)
    our_model.compile(optimizer=ours, loss="mse", **mode)
    our_model.fit(tokens, y, batch_size=B, shuffle=False, verbose=0)

    assert int(ours.iterations) == WINDOWS
    if features:
        assert int(ours.skipped_micro_batches) == 0
        assert np.isfinite(float(ours.window_gradient_sq_norm))
    assert_same_state(ours, parent_model, our_model, parent)
    initial = _embedding_model(11).get_weights()[0]
    table = our_model.get_weights()[0]
    np.testing.assert_array_equal(table[-UNUSED:], initial[-UNUSED:])
    assert not np.allclose(table[:-UNUSED], initial[:-UNUSED])


@pytest.mark.backends("tensorflow", "jax")
def test_compiled_custom_loop_equals_parent_big_batch():
    x, y = regression_data(10, WINDOWS * K * B)
    parent_model, our_model = small_model(10), small_model(10)
    parent = keras.optimizers.Adam(0.01)
    ours = AdamAccumulate(0.01, accum_iters=K)
    step = compiled_step(our_model, ours)
    train_in_batches(parent, parent_model, x, y, K * B)
    for start in range(0, len(x), B):
        step(x[start : start + B], y[start : start + B])
    assert int(ours.iterations) == WINDOWS
    assert_same_state(ours, parent_model, our_model, parent)


@pytest.mark.backends("tensorflow")
def test_a_tf_function_loop_runs_our_code_as_written_and_says_nothing(
    capfd, caplog
):
    # Keras' guide to a training loop from scratch: `tf.function` around the
    # tape and `apply`. AutoGraph converts what such a function calls; it
    # must leave our methods as written (as `fit` does), without its "could
    # not transform ... report this to the TensorFlow team" warning.
    import warnings

    import tensorflow as tf

    tf.autograph.set_verbosity(0)  # the default
    x, y = regression_data(12, WINDOWS * K * B)
    parent_model, our_model = small_model(12), small_model(12)
    parent = keras.optimizers.Adam(0.01)
    ours = AdamAccumulate(0.01, accum_iters=K)
    step = compiled_step(our_model, ours)
    capfd.readouterr()
    recording = warnings.catch_warnings(record=True)
    with caplog.at_level("INFO"), recording as caught:
        warnings.simplefilter("always")
        for start in range(0, len(x), B):
            step(x[start : start + B], y[start : start + B])
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), out + err
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert not caught, [str(w.message) for w in caught]
    train_in_batches(parent, parent_model, x, y, K * B)
    assert int(ours.iterations) == WINDOWS
    assert_same_state(ours, parent_model, our_model, parent)


@pytest.mark.backends("jax")
def test_jax_update_math_runs_inside_the_gate_loop():
    """The jitted step holds one `while` (zero trips or one) whose body
    carries the whole update; outside it only the adds and the counters."""
    import jax

    model = small_model(0)
    optimizer = AdamAccumulate(accum_iters=4)
    optimizer.build(model.trainable_variables)
    grads = [np.ones(v.shape, "float32") for v in model.trainable_variables]
    jaxpr = jax.make_jaxpr(optimizer.stateless_apply)(
        [v.value for v in optimizer.variables],
        grads,
        [v.value for v in model.trainable_variables],
    )
    primitives = [e.primitive.name for e in jaxpr.eqns]
    assert "cond" not in primitives
    loops = [e for e in jaxpr.eqns if e.primitive.name == "while"]
    assert len(loops) == 1
    # The loop's condition is its carried flag alone; the body is the update.
    assert len(loops[0].params["cond_jaxpr"].jaxpr.eqns) == 0
    assert len(loops[0].params["body_jaxpr"].jaxpr.eqns) > 20
    assert len(jaxpr.eqns) < 6 * len(grads) + 20


@pytest.mark.backends("tensorflow")
def test_tensorflow_xla_step_copies_no_model_variable():
    """Under XLA the close is a loop of zero or one trip: a conditional
    would copy every variable the close writes through its branch not
    taken, on every step; counted in the compiled step's optimized HLO."""
    import re

    import tensorflow as tf

    model = small_model(0)
    model.compile(AdamAccumulate(accum_iters=4), "mse", jit_compile=True)
    x, y = regression_data(0, 8)
    model.fit(x, y, batch_size=2, verbose=0)
    step = tf.function(model.train_step, jit_compile=True)
    hlo = step.experimental_get_compiler_ir((x[:2], y[:2]))("optimized_hlo")
    shapes = {
        "f32[" + ",".join(map(str, v.shape)) + "]"
        for v in model.trainable_variables
    }
    copied = re.findall(r"= (f32\[[\d,]*\])\S* copy\(", hlo)
    assert " while(" in hlo
    assert not [shape for shape in copied if shape in shapes], copied


def _program_of(step_text):
    """A compiled program's text without its names, metadata and source
    locations (JAX's tables, `FileNames` to `StackFrames`): two programs
    that compute the same thing the same way read the same."""
    import re

    tables = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    blocks = step_text.split("\n\n")
    text = "\n".join(b for b in blocks if not b.startswith(tables))
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%_", text)
    return [line for line in text.splitlines()[1:] if line.strip()]


@pytest.mark.backends("tensorflow", "jax")
def test_accum_iters_1_compiles_to_the_parents_own_program():
    """`accum_iters=1` without features keeps no window: its train step
    under XLA is the parent's, instruction for instruction, so it costs
    what the parent costs."""
    programs = []
    for optimizer in (keras.optimizers.Adam(), AdamAccumulate(accum_iters=1)):
        model = small_model(0)
        model.compile(optimizer, "mse", jit_compile=True)
        x, y = regression_data(0, 4)
        model.fit(x, y, batch_size=2, verbose=0)
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            step = tf.function(model.train_step, jit_compile=True)
            text = step.experimental_get_compiler_ir((x[:2], y[:2]))(
                "optimized_hlo"
            )
        else:
            import jax

            state = (
                [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                [v.value for v in optimizer.variables],
                [v.value for v in model.metrics_variables],
            )
            text = (
                jax.jit(model.train_step)
                .lower(state, (x[:2], y[:2]))
                .compile()
                .as_text()
            )
        programs.append(_program_of(text))
    assert len(programs[0]) > 50
    assert programs[0] == programs[1]
