"""Optuna sweep over `accum_iters` x learning rate at a constant effective
batch, with `AdamAccumulate` and pruning.

Every trial updates the weights with batches of `EFFECTIVE_BATCH` samples:
`accum_iters` micro-batches of `EFFECTIVE_BATCH // accum_iters`. A Keras
callback reports each epoch's validation loss to Optuna, which prunes
trials that fall behind. The best trial's model is then trained again,
saved to a `.keras` file, loaded again and evaluated.

    python examples/optuna_sweep.py [--trials 8] [--epochs 5]
        [--directory optuna_sweep]

Distributed tuning: give every process the same `--storage` (a database
URL, e.g. `sqlite:///sweep.db` on a shared disk, or a PostgreSQL/MySQL
server for several machines) and `--search-only`; each process runs
`--trials` trials of the shared study. Then run it once more with
`--trials 0` to train and save the best trial's model. Needs `optuna` and
scikit-learn (its 8x8 digits ship with it).
"""

import argparse
import os

import keras
import numpy as np
import optuna
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


class OptunaPruning(keras.callbacks.Callback):
    """Reports `monitor` to an Optuna trial after every epoch and stops
    training with `optuna.TrialPruned` when the pruner says so.

    Args:
        trial: The `optuna.Trial` being run.
        monitor: String. The `logs` entry to report. Defaults to
            `"val_loss"`.
    """

    def __init__(self, trial, monitor="val_loss"):
        super().__init__()
        self.trial = trial
        self.monitor = monitor

    def on_epoch_end(self, epoch, logs=None):
        self.trial.report(float(logs[self.monitor]), step=epoch)
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned after epoch {epoch + 1}")


def build_model(learning_rate, accum_iters):
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


def train(params, data, epochs, callbacks=()):
    """Builds and fits the model for `params`; returns it and its History."""
    (x, y), validation = data
    accum_iters = params["accum_iters"]
    model = build_model(params["learning_rate"], accum_iters)
    history = model.fit(
        x,
        y,
        # The micro-batch that keeps the effective batch constant.
        batch_size=EFFECTIVE_BATCH // accum_iters,
        epochs=epochs,
        validation_data=validation,
        # Applies each epoch's last, partial window, so every trial makes
        # the same updates per epoch as one batch of EFFECTIVE_BATCH would.
        callbacks=[FlushAccumulation(), *callbacks],
        verbose=0,
    )
    return model, history


def objective(data, epochs):
    def run(trial):
        params = {
            "accum_iters": trial.suggest_categorical(
                "accum_iters", ACCUM_ITERS
            ),
            "learning_rate": trial.suggest_float(
                "learning_rate", 1e-3, 3e-2, log=True
            ),
        }
        keras.utils.set_random_seed(trial.number)
        _, history = train(params, data, epochs, [OptunaPruning(trial)])
        return min(history.history["val_loss"])

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--train-size", type=int, default=1000, help="at most 1000"
    )
    parser.add_argument("--directory", default="optuna_sweep")
    parser.add_argument("--storage", default=None)
    parser.add_argument("--study-name", default="accum_iters")
    parser.add_argument("--search-only", action="store_true")
    args = parser.parse_args(argv)

    train_data, validation, (x_test, y_test) = digits(args.train_size)
    data = (train_data, validation)
    study = optuna.create_study(
        study_name=args.study_name,
        storage=args.storage,
        load_if_exists=True,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2),
    )
    if args.trials:
        study.optimize(objective(data, args.epochs), n_trials=args.trials)
    if args.search_only:
        return

    for trial in study.trials:
        print(
            f"trial {trial.number}: {trial.state.name.lower()} "
            f"accum_iters={trial.params['accum_iters']} "
            f"batch_size={EFFECTIVE_BATCH // trial.params['accum_iters']} "
            f"learning_rate={trial.params['learning_rate']:.5f} "
            f"value={trial.value}"
        )
    best = study.best_trial
    keras.utils.set_random_seed(best.number)
    model, _ = train(best.params, data, args.epochs)
    before = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    os.makedirs(args.directory, exist_ok=True)
    path = os.path.join(args.directory, "best.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    after = loaded.evaluate(x_test, y_test, verbose=0, return_dict=True)
    print(f"best trial: {best.number} {best.params}")
    print(f"best model: test loss {before['loss']:.6f}")
    print(f"loaded from {path}: test loss {after['loss']:.6f}")
    same = np.isclose(before["loss"], after["loss"], rtol=1e-6)
    print(f"loaded model evaluates the same: {same}")


if __name__ == "__main__":
    main()
