"""keras_hub task models (`CausalLM`, `TextClassifier`) built from a backbone
config, no download: an accumulating optimizer trains them exactly like the
parent on the big batch, and `load_training_state` resumes them with that
optimizer and its pending window (`.keras` loading recompiles them with a
fresh `Adam`). The recipe in docs/saving.md."""

import keras
import numpy as np
import pytest

from accum_optimizers import AdamAccumulate
from accum_optimizers import load_training_state

keras_hub = pytest.importorskip(
    "keras_hub",
    reason="keras-hub not installed: "
    "pip install --no-deps -r requirements/keras-hub.txt",
)

VOCAB, LENGTH, CLASSES = 24, 6, 3
# The backbones' arguments: one tiny layer, no dropout.
BACKBONE = dict(
    vocabulary_size=VOCAB,
    num_layers=1,
    num_heads=2,
    hidden_dim=8,
    intermediate_dim=16,
    dropout=0.0,
    max_sequence_length=LENGTH,
)


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def causal_lm(seed):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(**BACKBONE)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def causal_lm_data(seed, n):
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (n, LENGTH + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((n, LENGTH), "int32"),
    }
    return x, tokens[:, 1:].astype("int32")


def text_classifier(seed):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(**BACKBONE)
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=CLASSES, preprocessor=None, dropout=0.0
    )


def text_classifier_data(seed, n):
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(0, VOCAB, (n, LENGTH)).astype("int32"),
        "segment_ids": np.zeros((n, LENGTH), "int32"),
        "padding_mask": np.ones((n, LENGTH), "int32"),
    }
    return x, rng.integers(0, CLASSES, n).astype("int32")


TASKS = {
    "CausalLM": (causal_lm, causal_lm_data),
    "TextClassifier": (text_classifier, text_classifier_data),
}


def _fit(model, x, y, batch_size):
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)


def _assert_same_weights(model, expected, **tolerance):
    for ours, theirs in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(ours, theirs, **tolerance)


def _rows(x, y, rows):
    return {k: v[rows] for k, v in x.items()}, y[rows]


def _big_batch_adam():
    """The parent on the big batch's gradient. On TensorFlow an embedding's
    gradient is `IndexedSlices` with a row per token, and Keras' Adam
    squares each row before adding repeats: not the big batch's gradient,
    which a window sums densely (as JAX and torch compute it). The oracle
    takes the dense gradient there too."""
    if keras.backend.backend() != "tensorflow":
        return keras.optimizers.Adam(1e-2)
    import tensorflow as tf

    class DenseGradientAdam(keras.optimizers.Adam):
        def apply(self, grads, trainable_variables=None):
            grads = [
                tf.convert_to_tensor(g)
                if isinstance(g, tf.IndexedSlices)
                else g
                for g in grads
            ]
            return super().apply(grads, trainable_variables)

    return DenseGradientAdam(1e-2)


@pytest.mark.parametrize("task", ["CausalLM", "TextClassifier"])
def test_task_model_trains_like_the_parent_on_the_big_batch(task):
    make, data = TASKS[task]
    x, y = data(0, 16)
    ours, big = make(0), make(0)
    ours.compile(optimizer=AdamAccumulate(1e-2, accum_iters=4), loss=_loss())
    big.compile(optimizer=_big_batch_adam(), loss=_loss())
    _fit(ours, x, y, batch_size=2)
    _fit(big, x, y, batch_size=8)
    assert type(ours.optimizer) is AdamAccumulate
    assert int(ours.optimizer.iterations) == 2
    _assert_same_weights(ours, big, rtol=1e-4, atol=1e-5)


# `.keras` for the CausalLM, `.weights.h5` for the TextClassifier: each
# file kind once, each task once.
@pytest.mark.parametrize(
    "task, suffix", [("CausalLM", ".keras"), ("TextClassifier", ".weights.h5")]
)
def test_task_model_resumes_with_its_optimizer_and_pending_window(
    task, suffix, tmp_path
):
    make, data = TASKS[task]
    x, y = data(1, 12)
    uninterrupted = make(0)
    uninterrupted.compile(
        optimizer=AdamAccumulate(1e-2, accum_iters=3), loss=_loss()
    )
    _fit(uninterrupted, x, y, batch_size=2)

    interrupted = make(0)
    interrupted.compile(
        optimizer=AdamAccumulate(1e-2, accum_iters=3), loss=_loss()
    )
    _fit(interrupted, *_rows(x, y, slice(0, 8)), batch_size=2)
    assert int(interrupted.optimizer.micro_steps) == 1
    path = tmp_path / f"task{suffix}"
    if suffix == ".keras":
        interrupted.save(path)
    else:
        interrupted.save_weights(path)

    restored = make(1)  # other initial weights: all must come from the file
    restored.compile(
        optimizer=AdamAccumulate(1e-2, accum_iters=3), loss=_loss()
    )
    assert load_training_state(restored, path) is restored
    assert type(restored.optimizer) is AdamAccumulate
    assert int(restored.optimizer.iterations) == 1
    assert int(restored.optimizer.micro_steps) == 1
    _fit(restored, *_rows(x, y, slice(8, 12)), batch_size=2)
    assert int(restored.optimizer.iterations) == 2
    _assert_same_weights(restored, uninterrupted, rtol=1e-5, atol=1e-6)


def test_load_training_state_refuses_an_uncompiled_model(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="optimizer=None"):
        load_training_state(model, tmp_path / "never.keras")
