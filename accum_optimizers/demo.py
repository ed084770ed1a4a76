"""Demo: accumulating k micro-batches trains like one batch k times larger.

Trains one small classifier on scikit-learn's 8x8 digits (shipped with
scikit-learn, no download) four times, from the same initial weights, in the
same data order, with a cosine-decay learning-rate schedule over the run's
updates:

1. `keras.optimizers.Adam` at batch `k * b`: the big-batch run to match;
2. `AdamAccumulate(accum_iters=k)` at batch `b`;
3. `keras.optimizers.Adam` at batch `b`: no accumulation, for contrast;
4. `keras.optimizers.Adam(gradient_accumulation_steps=k)` at batch `b`:
   Keras' built-in accumulation, whose schedule is called with micro-steps.

It prints each run's test loss and accuracy, and how far its weights end
from the big-batch run's. `--plot PATH` also draws the loss curves and that
distance after every update of the big-batch run.

    python -m accum_optimizers.demo [--accum-iters 4] [--micro-batch 16]
                                    [--epochs 10] [--train-images 1440]
                                    [--seed 0] [--plot demo.png]
"""

from accum_optimizers import _demo_cli

# Before TensorFlow loads (`python -m accum_optimizers.demo` did this in the
# package's `__init__`): its C++ start-up logs are noise here.
_demo_cli.quiet_tensorflow()

import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from dataclasses import field  # noqa: E402
from typing import Any  # noqa: E402
from typing import Optional  # noqa: E402
from typing import Sequence  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_optimizers import AdamAccumulate  # noqa: E402
from accum_optimizers._backend import quiet_python_logger  # noqa: E402
from accum_optimizers._demo_cli import DIGITS  # noqa: E402
from accum_optimizers._demo_cli import TRAIN_IMAGES  # noqa: E402
from accum_optimizers._demo_cli import parse_args  # noqa: E402

LEARNING_RATE = 5e-3


@dataclass
class Run:
    """One training run and what the demo reports about it.

    Args:
        label: The run's name in the table and the plot.
        batch_size: The batch passed to `model.fit`.
        model: The trained model.
        seconds: Wall time of `model.fit`, compilation included.
        epoch_losses: Mean training loss of each epoch.
        trajectory: Flat weights after each update of the big-batch run
            (every `accum_iters` batches at the micro-batch size); empty
            unless recorded.
        test_loss: Loss on the held-out images.
        test_accuracy: Accuracy on the held-out images.
    """

    label: str
    batch_size: int
    model: Any
    seconds: float
    epoch_losses: list
    trajectory: list = field(default_factory=list)
    test_loss: float = 0.0
    test_accuracy: float = 0.0

    def flat_weights(self) -> np.ndarray:
        """The trained model's weights, flattened into one array."""
        return _flatten(self.model.get_weights())


def _flatten(weights: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(w) for w in weights])


class _RecordWeights(keras.callbacks.Callback):
    """Stores the flat weights after every `every`-th batch."""

    def __init__(self, every: int, trajectory: list) -> None:
        super().__init__()
        self.every = every
        self.trajectory = trajectory
        self.batches = 0

    def on_train_begin(self, logs: Optional[dict[str, Any]] = None) -> None:
        self.trajectory.append(_flatten(self.model.get_weights()))

    def on_train_batch_end(
        self, batch: int, logs: Optional[dict[str, Any]] = None
    ) -> None:
        self.batches += 1
        if self.batches % self.every == 0:
            self.trajectory.append(_flatten(self.model.get_weights()))


def load_digits(
    train_size: int,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Loads scikit-learn's 8x8 digits, scaled to `[0, 1]`.

    Args:
        train_size: the number of training images (the first ones); the
            rest are the test images.

    Returns:
        `((x_train, y_train), (x_test, y_test))`.

    Raises:
        SystemExit: without scikit-learn, saying how to install it.
    """
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


def build_model(seed: int) -> keras.Model:
    """A 64-64-32-10 classifier whose initial weights depend only on `seed`.

    Args:
        seed: the Keras random seed of the initial weights.

    Returns:
        An uncompiled `keras.Sequential`.
    """
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def cosine_schedule(
    updates: int,
) -> keras.optimizers.schedules.LearningRateSchedule:
    """Cosine decay from `LEARNING_RATE` to 0 over `updates` updates.

    Args:
        updates: the run's number of updates.

    Returns:
        A `keras.optimizers.schedules.CosineDecay`.
    """
    return keras.optimizers.schedules.CosineDecay(LEARNING_RATE, updates)


def train(
    label: str,
    optimizer: keras.optimizers.Optimizer,
    batch_size: int,
    data: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    epochs: int,
    seed: int,
    record_every: Optional[int] = None,
) -> Run:
    """Trains a fresh model with `optimizer`.

    Args:
        label: the run's name.
        optimizer: the optimizer to compile the model with.
        batch_size: the batch passed to `fit`.
        data: `((x_train, y_train), (x_test, y_test))`.
        epochs: the epochs to train.
        seed: the seed of the initial weights.
        record_every: record the flat weights every this many batches;
            `None` records nothing.

    Returns:
        The `Run`.
    """
    (x_train, y_train), (x_test, y_test) = data
    model = build_model(seed)
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    trajectory: list[np.ndarray] = []
    callbacks = []
    if record_every:
        callbacks.append(_RecordWeights(record_every, trajectory))
    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    seconds = time.perf_counter() - start
    test_loss, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
    return Run(
        label,
        batch_size,
        model,
        seconds,
        list(history.history["loss"]),
        trajectory,
        float(test_loss),
        float(test_accuracy),
    )


def compare(
    accum_iters: int = 4,
    micro_batch: int = 16,
    epochs: int = 10,
    seed: int = 0,
    record: bool = False,
    train_images: int = TRAIN_IMAGES,
) -> list[Run]:
    """Trains the big batch, `AdamAccumulate`, the micro-batch and Keras'
    own accumulation, from the same initial weights.

    Args:
        accum_iters: micro-batches per window.
        micro_batch: the micro-batch size.
        epochs: the epochs to train.
        seed: the seed of the initial weights.
        record: record the weights after every update, for `plot`.
        train_images: the training images (whole big batches of them are
            used).

    Returns:
        The four `Run`s, the big batch first.

    Raises:
        ValueError: if `train_images` holds no big batch.
    """
    big_batch = accum_iters * micro_batch
    # Whole windows only: the training set is a multiple of the big batch.
    train_size = (train_images // big_batch) * big_batch
    if train_size == 0:
        raise ValueError(
            "`train_images` must hold at least one big batch of "
            f"{big_batch} images. Received: train_images={train_images}"
        )
    data = load_digits(train_size)
    updates = epochs * train_size // big_batch
    big_every = 1 if record else None
    micro_every = accum_iters if record else None
    k = accum_iters
    return [
        train(
            f"Adam, batch {big_batch}",
            keras.optimizers.Adam(cosine_schedule(updates)),
            big_batch,
            data,
            epochs,
            seed,
            big_every,
        ),
        train(
            f"AdamAccumulate(accum_iters={k}), batch {micro_batch}",
            AdamAccumulate(cosine_schedule(updates), accum_iters=k),
            micro_batch,
            data,
            epochs,
            seed,
            micro_every,
        ),
        train(
            f"Adam, batch {micro_batch}",
            # Its own run's updates: k times as many.
            keras.optimizers.Adam(cosine_schedule(k * updates)),
            micro_batch,
            data,
            epochs,
            seed,
            micro_every,
        ),
        train(
            f"Adam(gradient_accumulation_steps={k}), batch {micro_batch}",
            keras.optimizers.Adam(
                cosine_schedule(updates), gradient_accumulation_steps=k
            ),
            micro_batch,
            data,
            epochs,
            seed,
            micro_every,
        ),
    ]


def distances(runs: Sequence[Run]) -> list[float]:
    """Each run's distance from the first.

    Args:
        runs: the runs, the reference first.

    Returns:
        Per run, the max |weight difference| of its final weights to the
        first run's.
    """
    reference = runs[0].flat_weights()
    return [
        float(np.max(np.abs(run.flat_weights() - reference))) for run in runs
    ]


def report(runs: Sequence[Run], accum_iters: int) -> str:
    """The comparison table, what it shows, and a line on the timings.

    Args:
        runs: the four runs of `compare`.
        accum_iters: their window size.

    Returns:
        The report's text.
    """
    ours, small = runs[1], runs[2]
    gaps = distances(runs)
    updates = [int(run.model.optimizer.iterations) for run in runs]
    lines = [
        f"{'run':<45} {'updates':>7} {'test loss':>9} {'accuracy':>8} "
        f"{'max |w - w_big|':>15} {'fit s':>6}"
    ]
    for run, count, gap in zip(runs, updates, gaps):
        lines.append(
            f"{run.label:<45} {count:>7} {run.test_loss:>9.4f} "
            f"{run.test_accuracy:>8.4f} {gap:>15.2g} {run.seconds:>6.1f}"
        )
    k = accum_iters
    lines += [
        "",
        f"- AdamAccumulate matches the big batch to float32 round-off "
        f"({gaps[1]:.1g}): the same {updates[1]} updates, each on the mean "
        f"gradient of {k} micro-batches of {ours.batch_size}.",
        f"- Adam at batch {small.batch_size} is another training run: {k}x "
        f"as many updates, each on a noisier gradient; it ends {gaps[2]:.2g} "
        "away.",
        f"- Keras' built-in accumulation averages the same gradients, but "
        f"calls the schedule with micro-steps ({k * updates[3]}, not "
        f"{updates[3]}): the learning rate reaches 0 after 1/{k} of the run "
        f"and the weights end {gaps[3]:.2g} away.",
        f"- Timings (fit s, compilation included) differ because the runs at "
        f"batch {ours.batch_size} make {k}x as many steps, and on a model "
        "this small each step's fixed cost outweighs its arithmetic. "
        "Accumulation gives the big batch's result in the small batch's "
        "memory, not its speed.",
    ]
    return "\n".join(lines)


def plot(runs: Sequence[Run], accum_iters: int, path: str) -> None:
    """Writes a PNG: loss per epoch, and distance to the big batch per update.

    Needs the runs' recorded trajectories (`compare(record=True)`).

    Args:
        runs: the four runs of `compare`.
        accum_iters: their window size.
        path: the PNG file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, gaps) = plt.subplots(1, 2, figsize=(12, 4.5))
    reference = np.stack(runs[0].trajectory)
    # One colour per run in both panels; ours dashed, over the big batch.
    styles = [("black", "-"), ("tab:orange", "--"), ("tab:blue", "-")]
    styles.append(("tab:red", "-"))
    for run, (color, line) in zip(runs, styles):
        epochs = np.arange(1, len(run.epoch_losses) + 1)
        losses.plot(
            epochs, run.epoch_losses, line, color=color, label=run.label
        )
        if run is runs[0]:
            continue
        trajectory = np.stack(run.trajectory)[: len(reference)]
        distance = np.max(np.abs(trajectory - reference[: len(trajectory)]), 1)
        # Before the first update the distance is exactly 0: no log scale.
        gaps.plot(
            np.arange(1, len(distance)),
            distance[1:],
            line,
            color=color,
            label=run.label,
        )
    losses.set_xlabel("epoch")
    losses.set_ylabel("training loss (mean over the epoch)")
    losses.set_yscale("log")
    losses.set_title("Loss")
    losses.legend(fontsize=8)
    gaps.set_xlabel(
        f"updates of the big-batch run ({accum_iters} micro-batches each)"
    )
    gaps.set_ylabel("max |w - w_big|")
    gaps.set_yscale("log")
    gaps.set_title("Distance to the big-batch run's weights")
    gaps.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _quiet_python_logs() -> None:
    """Only errors from absl (TensorFlow's Python logger) and TensorFlow."""
    try:
        from absl import logging as absl_logging
    except ImportError:  # no TensorFlow installed
        return
    absl_logging.set_verbosity(absl_logging.ERROR)
    quiet_python_logger()


def main(argv: Optional[Sequence[str]] = None) -> list[Run]:
    """Runs the demo, as `python -m accum_optimizers.demo`.

    Args:
        argv: the command-line arguments; `None` reads `sys.argv`.

    Returns:
        The four `Run`s, the big batch first.

    Raises:
        SystemExit: for `--help`, a bad flag, or a missing package.
    """
    args = parse_args(argv)
    _quiet_python_logs()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise SystemExit(
                "--plot needs matplotlib: pip install matplotlib"
            ) from error
    k = args.accum_iters
    print(
        f"digits, backend {keras.backend.backend()}, epochs: {args.epochs}, "
        f"big batch {k * args.micro_batch} = {k} x {args.micro_batch}, "
        f"cosine-decay learning rate from {LEARNING_RATE:g} over the run's "
        "updates",
        flush=True,
    )
    if args.train_images >= DIGITS:
        raise SystemExit(
            f"--train-images must leave test images out of the {DIGITS}. "
            f"Received: --train-images {args.train_images}"
        )
    runs = compare(
        k,
        args.micro_batch,
        args.epochs,
        args.seed,
        record=bool(args.plot),
        train_images=args.train_images,
    )
    print(report(runs, k))
    if args.plot:
        plot(runs, k, args.plot)
        print(f"plot: {args.plot}")
    return runs


if __name__ == "__main__":
    main()
