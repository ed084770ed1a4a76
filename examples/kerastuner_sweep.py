"""KerasTuner sweep over `accum_iters` x learning rate at a constant
effective batch, with `AdamAccumulate`.

Every trial updates the weights with batches of `EFFECTIVE_BATCH` samples:
`accum_iters` micro-batches of `EFFECTIVE_BATCH // accum_iters`. Without
batch-statistics layers (BatchNorm) the trials with the same learning rate
train alike whatever `accum_iters` is, up to float round-off: `accum_iters`
is a memory knob, and the sweep shows it. The best model is then saved to
a `.keras` file, loaded again and evaluated.

    python examples/kerastuner_sweep.py [--trials 8] [--epochs 5]
        [--directory kerastuner_sweep]

Distributed tuning runs the same command on every machine, with the same
`--directory` on a shared file system, and these environment variables:

    KERASTUNER_TUNER_ID=chief   (workers: tuner0, tuner1, ...)
    KERASTUNER_ORACLE_IP=<the chief's address>
    KERASTUNER_ORACLE_PORT=<a free port on the chief>

The chief hands out trials and, when they are done, saves the best model;
the workers run the trials. Needs `keras-tuner` and scikit-learn (its 8x8
digits ship with it), and `tensorboard` on the TensorFlow backend.
"""

import argparse
import os

import keras
import keras_tuner
import numpy as np
from sklearn.datasets import load_digits

from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation

EFFECTIVE_BATCH = 64
ACCUM_ITERS = [1, 2, 4, 8]


def digits(train_size=1000):
    """Train, validation and test splits of scikit-learn's digits."""
    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    train = (x[:train_size], y[:train_size])
    return train, (x[1000:1400], y[1000:1400]), (x[1400:], y[1400:])


class AccumulationSweep(keras_tuner.HyperModel):
    """An MLP on digits; `accum_iters` and learning rate are tuned, and
    `fit` picks the micro-batch that keeps the effective batch constant."""

    def build(self, hp):
        accum_iters = hp.Choice("accum_iters", ACCUM_ITERS)
        learning_rate = hp.Float("learning_rate", 1e-3, 3e-2, sampling="log")
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            optimizer=AdamAccumulate(
                learning_rate=learning_rate, accum_iters=accum_iters
            ),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model

    def fit(self, hp, model, *args, **kwargs):
        kwargs["batch_size"] = EFFECTIVE_BATCH // hp.get("accum_iters")
        # Applies each epoch's last, partial window, so every trial makes
        # the same updates per epoch as one batch of EFFECTIVE_BATCH would.
        kwargs["callbacks"] = [
            *kwargs.get("callbacks", []),
            FlushAccumulation(),
        ]
        return model.fit(*args, **kwargs)


def is_worker():
    """Whether this process is a worker of a distributed search."""
    tuner_id = os.environ.get("KERASTUNER_TUNER_ID", "chief")
    return "KERASTUNER_ORACLE_IP" in os.environ and "chief" not in tuner_id


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--train-size", type=int, default=1000, help="at most 1000"
    )
    parser.add_argument("--directory", default="kerastuner_sweep")
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    train, validation, (x_test, y_test) = digits(args.train_size)
    tuner = keras_tuner.RandomSearch(
        AccumulationSweep(),
        objective="val_loss",
        max_trials=args.trials,
        seed=0,
        directory=args.directory,
        project_name="accum_iters",
        # Workers share the chief's directory: never delete it there.
        overwrite="KERASTUNER_ORACLE_IP" not in os.environ,
    )
    tuner.search(
        *train, epochs=args.epochs, validation_data=validation, verbose=0
    )
    if is_worker():
        return  # The chief reports and saves the best model.

    for trial in tuner.oracle.get_best_trials(args.trials):
        values = trial.hyperparameters.values
        print(
            f"accum_iters={values['accum_iters']} "
            f"batch_size={EFFECTIVE_BATCH // values['accum_iters']} "
            f"learning_rate={values['learning_rate']:.5f} "
            f"val_loss={trial.score:.4f}"
        )
    best = tuner.get_best_models(1)[0]
    before = best.evaluate(x_test, y_test, verbose=0, return_dict=True)
    path = os.path.join(args.directory, "best.keras")
    best.save(path)
    loaded = keras.saving.load_model(path)
    after = loaded.evaluate(x_test, y_test, verbose=0, return_dict=True)
    print(f"best model: test loss {before['loss']:.6f}")
    print(f"loaded from {path}: test loss {after['loss']:.6f}")
    same = np.isclose(before["loss"], after["loss"], rtol=1e-6)
    print(f"loaded model evaluates the same: {same}")


if __name__ == "__main__":
    main()
