"""`jit_compile`: in a TensorFlow graph without XLA, the window's close
runs as one XLA computation where it is asked for (`True`, or `"auto"`
from `2**17` parameters and 30,000 per variable) and XLA compiles it, and
trains as the parent does on the big batch either way; a close holding
graph checks (which XLA drops) runs as TensorFlow's ops, and they raise as
under the parent."""

import contextlib

import keras
import numpy as np
import pytest
from helpers import assert_same_weights
from helpers import fit_in_order
from helpers import regression_data
from helpers import small_model

from accum_optimizers import AdamAccumulate
from accum_optimizers import AdamWAccumulate

BACKEND = keras.backend.backend()
on_tensorflow = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="an XLA close of a TensorFlow graph"
)


@pytest.mark.parametrize("value", [1, "always", None])
def test_jit_compile_must_be_a_bool_or_auto(value):
    with pytest.raises(TypeError, match=f"jit_compile={value!r}"):
        AdamAccumulate(accum_iters=2, jit_compile=value)


@pytest.mark.parametrize("value", [False, True, "auto"])
def test_jit_compile_round_trips_its_config(value):
    config = AdamAccumulate(accum_iters=2, jit_compile=value).get_config()
    assert config["jit_compile"] == value
    assert AdamAccumulate.from_config(config).jit_compile == value
    assert AdamAccumulate().jit_compile == "auto"


def _xla_functions(model, x, y):
    """The functions of `model`'s traced train step that XLA compiles."""
    import tensorflow as tf

    step = tf.function(model.train_step)
    graph = step.get_concrete_function((x, y)).graph.as_graph_def()
    return [
        f.signature.name
        for f in graph.library.function
        if f.attr["_XlaMustCompile"].b
    ]


class _PythonDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Inverse time decay computed in Python (`tf.numpy_function`): XLA
    cannot compile it."""

    def __call__(self, step):
        import tensorflow as tf

        def decayed(step):
            return np.float32(0.05 / (1.0 + 0.5 * float(step)))

        rate = tf.numpy_function(decayed, [step], "float32")
        return tf.reshape(rate, ())


@on_tensorflow
@pytest.mark.parametrize(
    "jit_compile, schedule, compiled",
    [
        (True, False, True),
        (False, False, False),
        ("auto", False, False),
        (True, True, False),
    ],
    ids=["compiled", "not-asked", "auto-small", "not-compilable"],
)
def test_a_graph_close_is_compiled_where_xla_can_and_matches_the_big_batch(
    jit_compile, schedule, compiled
):
    x, y = regression_data(0, 24)
    k, b = 3, 4

    def optimizer(cls, **kwargs):
        learning_rate = _PythonDecay() if schedule else 0.05
        return cls(learning_rate, weight_decay=0.01, use_ema=True, **kwargs)

    parent = small_model(1)
    parent.compile(optimizer(keras.optimizers.AdamW), "mse", jit_compile=False)
    fit_in_order(parent, x, y, batch_size=k * b, epochs=2)
    ours = small_model(1)
    ours.compile(
        optimizer(AdamWAccumulate, accum_iters=k, jit_compile=jit_compile),
        "mse",
        jit_compile=False,
    )
    fit_in_order(ours, x, y, batch_size=b, epochs=2)
    assert_same_weights(ours, parent)
    assert bool(_xla_functions(ours, x[:b], y[:b])) == compiled


@on_tensorflow
@pytest.mark.parametrize("units, compiled", [(511, False), (512, True)])
def test_auto_compiles_the_close_from_two_to_the_seventeen_parameters(
    units, compiled
):
    # A kernel of 256 x 512 holds 2**17 parameters; 256 x 511 one row less.
    model = keras.Sequential(
        [keras.Input((256,)), keras.layers.Dense(units, use_bias=False)]
    )
    model.compile(AdamAccumulate(accum_iters=2), "mse", jit_compile=False)
    x = np.ones((2, 256), "float32")
    y = np.zeros((2, units), "float32")
    model.fit(x, y, batch_size=1, verbose=0)
    assert bool(_xla_functions(model, x[:1], y[:1])) == compiled


class _CheckedNumerics(keras.constraints.Constraint):
    """A constraint that only checks: `tf.debugging.check_numerics`."""

    def __call__(self, w):
        import tensorflow as tf

        return tf.debugging.check_numerics(w, "kernel checked")


class _AssertedRate(keras.optimizers.schedules.LearningRateSchedule):
    """A constant rate that asserts the update count is below `updates`."""

    def __init__(self, updates):
        self.updates = updates

    def __call__(self, step):
        import tensorflow as tf

        tf.debugging.assert_less(
            step, tf.cast(self.updates, step.dtype), message="rate checked"
        )
        return tf.constant(0.01)


# A kernel of 256 x 512: 2**17 parameters in one variable, which "auto"
# compiles; `True` compiles any size.
CHECKED_UNITS = {True: 4, "auto": 512}


def _checked_fit(optimizer, check, units, batch_size):
    """Fits a one-layer model with `check` on 8 samples: a constraint that
    checks the kernel's numbers (sample 5 is NaN, and so is the update of
    its batch), or `optimizer`'s schedule (`_AssertedRate`)."""
    constraint = _CheckedNumerics() if check == "constraint" else None
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(units, kernel_constraint=constraint),
        ]
    )
    model.compile(optimizer, "mse", jit_compile=False)
    x = np.ones((8, 256), "float32")
    y = np.zeros((8, units), "float32")
    if check == "constraint":
        x[5] = np.nan
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)


@on_tensorflow
@pytest.mark.parametrize("check", ["constraint", "schedule"])
@pytest.mark.parametrize("jit_compile", [True, "auto"])
def test_a_close_with_graph_checks_raises_where_the_parent_raises(
    check, jit_compile
):
    import tensorflow as tf

    units = CHECKED_UNITS[jit_compile]
    rate = _AssertedRate(2) if check == "schedule" else 0.01
    # The oracle: the parent on the big batches of 2 raises.
    with pytest.raises(tf.errors.InvalidArgumentError, match="checked"):
        _checked_fit(keras.optimizers.Adam(rate), check, units, 2)
    ours = AdamAccumulate(rate, accum_iters=2, jit_compile=jit_compile)
    # Asked to compile a close XLA would drop the checks of, it says why
    # it does not.
    warns = pytest.warns(UserWarning, match="graph checks")
    with warns if jit_compile is True else contextlib.nullcontext():
        with pytest.raises(tf.errors.InvalidArgumentError, match="checked"):
            _checked_fit(ours, check, units, 1)


@on_tensorflow
@pytest.mark.parametrize(
    "layers, width, compiled", [(2, 256, True), (8, 128, False)]
)
def test_auto_compiles_a_close_of_few_large_variables_not_many_small(
    layers, width, compiled
):
    # 2**17 parameters either way: 2 kernels of 256 x 256, or 8 of 128 x
    # 128. XLA's compile time grows with the variables, its saving with
    # their size: "auto" compiles from 30,000 parameters a variable (the
    # documented rule).
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, use_bias=False) for _ in range(layers)]
    )
    assert model.count_params() == 2**17
    model.compile(AdamAccumulate(accum_iters=2), "mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    x = np.ones((1, width), "float32")
    assert bool(_xla_functions(model, x, x)) == compiled
