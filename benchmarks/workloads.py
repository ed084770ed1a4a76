"""The three benchmark workloads: model builders, data, and micro-batch."""

import keras
import numpy as np
from keras import layers

# name -> (micro-batch, steps per timed repeat, steps in smoke mode)
WORKLOADS = {
    "mlp": (32, 96, 4),
    "convnet": (16, 24, 4),
    "transformer": (8, 24, 4),
}


def build(name, seed=0):
    keras.utils.set_random_seed(seed)
    if name == "mlp":
        return keras.Sequential(
            [
                keras.Input((256,)),
                layers.Dense(1024, activation="relu"),
                layers.Dense(1024, activation="relu"),
                layers.Dense(10),
            ]
        )
    if name == "convnet":
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                layers.Conv2D(32, 3, activation="relu", padding="same"),
                layers.MaxPooling2D(),
                layers.Conv2D(64, 3, activation="relu", padding="same"),
                layers.MaxPooling2D(),
                layers.Conv2D(128, 3, activation="relu", padding="same"),
                layers.GlobalAveragePooling2D(),
                layers.Dense(10),
            ]
        )
    if name == "transformer":
        return _transformer_encoder(sequence=64, width=128, heads=4)
    raise ValueError(f"Unknown workload: {name!r}")


def _transformer_encoder(sequence, width, heads, depth=2, vocabulary=1000):
    tokens = keras.Input((sequence,), dtype="int32")
    x = layers.Embedding(vocabulary, width)(tokens)
    for _ in range(depth):
        attended = layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = layers.LayerNormalization()(x + attended)
        hidden = layers.Dense(4 * width, activation="gelu")(x)
        x = layers.LayerNormalization()(x + layers.Dense(width)(hidden))
    outputs = layers.Dense(10)(layers.GlobalAveragePooling1D()(x))
    return keras.Model(tokens, outputs)


def data(name, samples, seed=0):
    rng = np.random.default_rng(seed)
    if name == "mlp":
        x = rng.normal(size=(samples, 256)).astype("float32")
    elif name == "convnet":
        x = rng.normal(size=(samples, 32, 32, 3)).astype("float32")
    else:
        x = rng.integers(0, 1000, size=(samples, 64)).astype("int32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    return x, y
