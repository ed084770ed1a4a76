"""Demo: accumulation over k micro-batches trains like one batch k times larger.

Trains the same small classifier on scikit-learn's 8x8 digits (shipped with
scikit-learn, no download) twice, from the same initial weights and in the
same data order:

1. `keras.optimizers.Adam` with `batch_size = accum_iters * micro_batch`;
2. `AdamAccumulate(accum_iters=...)` with `batch_size = micro_batch`.

It prints both runs' loss and accuracy and the largest weight difference.

    python -m accum_optimizers.demo [--accum-iters 4] [--micro-batch 16]
"""

import argparse
import time

import keras
import numpy as np

from accum_optimizers import AdamAccumulate


def load_digits(train_size):
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise SystemExit(
            "The demo needs scikit-learn for its data set: "
            'pip install "accum-optimizers[demo]"'
        ) from error
    digits = sklearn_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return (x[:train_size], y[:train_size]), (x[train_size:], y[train_size:])


def build_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def train(optimizer, batch_size, data, epochs, seed):
    (x_train, y_train), (x_test, y_test) = data
    model = build_model(seed)
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return model, loss, accuracy, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accum-iters", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    big_batch = args.accum_iters * args.micro_batch
    # Whole windows only: the training set is a multiple of the big batch.
    train_size = (1440 // big_batch) * big_batch
    data = load_digits(train_size)

    print(
        f"digits: {train_size} training / {len(data[1][0])} test images, "
        f"backend {keras.backend.backend()}, {args.epochs} epochs"
    )
    big, big_loss, big_acc, big_s = train(
        keras.optimizers.Adam(1e-3), big_batch, data, args.epochs, args.seed
    )
    acc, acc_loss, acc_acc, acc_s = train(
        AdamAccumulate(1e-3, accum_iters=args.accum_iters),
        args.micro_batch,
        data,
        args.epochs,
        args.seed,
    )
    rows = [
        (f"Adam, batch {big_batch}", big_loss, big_acc, big_s),
        (
            f"AdamAccumulate(accum_iters={args.accum_iters}), "
            f"batch {args.micro_batch}",
            acc_loss,
            acc_acc,
            acc_s,
        ),
    ]
    for label, loss, accuracy, seconds in rows:
        print(
            f"{label:<40} test loss {loss:.5f}  accuracy {accuracy:.4f}  "
            f"fit {seconds:.1f} s"
        )
    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(big.get_weights(), acc.get_weights())
    )
    print(f"largest weight difference: {difference:.3g}")
    print(
        f"updates applied: {int(big.optimizer.iterations)} and "
        f"{int(acc.optimizer.iterations)}"
    )
    return difference


if __name__ == "__main__":
    main()
