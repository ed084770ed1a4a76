"""The demo's command line, which imports no Keras.

`python -m accum_optimizers.demo` imports the package, and so Keras and
TensorFlow, before the demo's first line. The package's `__init__` calls
`before_keras` first: it quiets TensorFlow's C++ start-up logs, and answers
`--help` (and a malformed command line) at once, without Keras.
"""

import argparse
import os
from typing import Optional
from typing import Sequence

DIGITS = 1797  # images in scikit-learn's digits
TRAIN_IMAGES = 1440  # the rest is the test set


def quiet_tensorflow() -> None:
    """Hides TensorFlow's C++ start-up lines, unless the user set these.

    `TF_CPP_MIN_LOG_LEVEL=3` hides most of them; TensorFlow 2.21 still
    prints the oneDNN notice (and absl's "before InitializeLog" line with
    it) unless oneDNN's custom ops are off.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def before_keras(argv: Sequence[str]) -> None:
    """Run by the package's `__init__` under `python -m
    accum_optimizers.demo`, before Keras is imported: exits after
    printing the help (or a usage error), without importing Keras."""
    quiet_tensorflow()
    if any(arg in ("-h", "--help") for arg in argv):
        parse_args(argv)  # prints the help and exits
    # A malformed command line fails here, before TensorFlow loads.
    parse_args(argv)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m accum_optimizers.demo",
        description=(
            "Trains a digits classifier with Adam at batch k*b, "
            "AdamAccumulate(accum_iters=k) at batch b, Adam at batch b and "
            "Keras' built-in gradient_accumulation_steps=k at batch b, and "
            "shows how far each ends from the big-batch run."
        ),
    )
    parser.add_argument(
        "--accum-iters",
        type=_positive_int,
        default=4,
        metavar="K",
        help="micro-batches per update, k (default: %(default)s)",
    )
    parser.add_argument(
        "--micro-batch",
        type=_positive_int,
        default=16,
        metavar="B",
        help="micro-batch size b; the big batch is k*b (default: %(default)s)",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=10,
        help="passes over the training images (default: %(default)s)",
    )
    parser.add_argument(
        "--train-images",
        type=_positive_int,
        default=TRAIN_IMAGES,
        metavar="N",
        help="training images, rounded down to whole big batches; the rest "
        f"of the {DIGITS} digits is the test set (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial weights, shared by every run "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="also write a PNG of the loss curves and of each run's distance "
        "to the big-batch run after every update (needs matplotlib)",
    )
    return parser.parse_args(argv)
