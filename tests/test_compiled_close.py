"""`jit_compile`: in a TensorFlow graph without XLA, the window's close
runs as one XLA computation where XLA compiles it, and trains as the parent
does on the big batch either way."""

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


def test_jit_compile_must_be_a_bool():
    with pytest.raises(TypeError, match="jit_compile=1"):
        AdamAccumulate(accum_iters=2, jit_compile=1)


def test_jit_compile_round_trips_its_config():
    config = AdamAccumulate(accum_iters=2, jit_compile=False).get_config()
    assert config["jit_compile"] is False
    assert AdamAccumulate.from_config(config).jit_compile is False
    assert AdamAccumulate().jit_compile is True


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
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["compiled", "not-asked", "not-compilable"],
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
