"""Uneven micro-batches: the accumulated run against the big batch.

    python examples/uneven_batches.py [--samples 1780] [--epochs 3]

Trains the same MLP on scikit-learn's digits from the same initial weights:
Adam at batch 64 (the big batch), and `AdamAccumulate(accum_iters=4)` at
batch 16 three ways: plain, with `FlushAccumulation`, and with
`FlushAccumulation` plus `weigh_micro_batches(model)`. Then the same for a
masked sequence model (an `Embedding(mask_zero=True)` on variable-length
sequences of the digits' pixels), whose losses Keras divides by the number of
valid tokens, with SGD with momentum. Prints the largest weight difference
from the big batch for each run.
"""

import argparse

import keras
import numpy as np
from sklearn.datasets import load_digits

from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import weigh_micro_batches

K, B = 4, 16


def digits(samples):
    x, y = load_digits(return_X_y=True)
    return (x[:samples] / 16.0).astype("float32"), y[:samples]


def sequences(samples):
    """Each image as a sequence of its non-zero pixel intensities (1-16),
    padded with 0: 9 to 50 valid tokens of 64; the label, per token."""
    x, y = load_digits(return_X_y=True)
    x, y = x[:samples].astype("int32"), y[:samples]
    tokens = np.zeros_like(x)
    for row, pixels in zip(tokens, x):
        valid = pixels[pixels > 0]
        row[: len(valid)] = valid
    labels = np.repeat(y[:, None], x.shape[1], axis=1)
    return tokens, labels


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def sequence_model():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((64,), dtype="int32")
    hidden = keras.layers.Embedding(17, 16, mask_zero=True)(tokens)
    return keras.Model(tokens, keras.layers.Dense(10)(hidden))


def compare(make, parent, ours, x, y, epochs):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    big = make()
    big.compile(optimizer=parent(), loss=loss)
    big.fit(x, y, batch_size=K * B, epochs=epochs, shuffle=False, verbose=0)
    runs = {
        "plain": (False, []),
        "FlushAccumulation": (False, [FlushAccumulation()]),
        "weigh_micro_batches + FlushAccumulation": (
            True,
            [FlushAccumulation()],
        ),
    }
    for name, (weigh, callbacks) in runs.items():
        model = make()
        model.compile(optimizer=ours(), loss=loss)
        if weigh:
            weigh_micro_batches(model)
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        difference = max(
            float(np.abs(a - b).max())
            for a, b in zip(model.get_weights(), big.get_weights())
        )
        print(f"  {name:42s} max |dw| = {difference:.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1780)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{args.samples} samples, {args.epochs} epochs, "
        f"batch {K * B} against {K} x {B}; backend "
        f"{keras.backend.backend()}"
    )
    print("digits MLP, Adam:")
    compare(
        mlp,
        lambda: keras.optimizers.Adam(1e-3),
        lambda: AdamAccumulate(1e-3, accum_iters=K),
        *digits(args.samples),
        args.epochs,
    )
    print("masked sequences, SGD with momentum:")
    compare(
        sequence_model,
        lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        lambda: SGDAccumulate(0.05, momentum=0.9, accum_iters=K),
        *sequences(args.samples),
        args.epochs,
    )


if __name__ == "__main__":
    main()
