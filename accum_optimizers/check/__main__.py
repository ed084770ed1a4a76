"""`python -m accum_optimizers.check model.keras data.npz --batch-size 8`:
`check_exactness` on a saved model and a data file.

The `.npz` file holds arrays `x` and `y`, and optionally `sample_weight`.
The model is loaded with `keras.saving.load_model`, compiled as it was
saved, optimizer included. Exits with status 0 when the run is exact, 1
when it drifts, 2 on a usage error (a file that cannot be read, a model or
data the check cannot take), with one line on stderr saying what is wrong,
and 3 when the check fails while training, with its traceback: only a run
that trained and drifted exits 1.
"""

import argparse
import os
import sys
import traceback
import zipfile

import keras
import numpy as np

from accum_optimizers.callbacks import FlushAccumulation
from accum_optimizers.check import check_arguments
from accum_optimizers.check import check_exactness
from accum_optimizers.weighting import weigh_micro_batches

PROG = "python -m accum_optimizers.check"

# The exit statuses (see the module docstring).
EXACT, DRIFTS, USAGE_ERROR, FAILED = 0, 1, 2, 3

# The arrays of the data file, in `check_exactness`'s argument names.
_ARRAYS = ("x", "y", "sample_weight")


class UsageError(Exception):
    """What the user gave cannot be checked; the message says why, in one
    line."""


class _Parser(argparse.ArgumentParser):
    # One line on stderr, as every other usage error (`--help` shows the
    # usage).
    def error(self, message):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1. Received: {text!r}"
        )
    return value


def parse_args(argv=None):
    parser = _Parser(
        prog=PROG,
        description=(
            "Trains copies of a saved model with its accumulating optimizer "
            "at batch b and with the parent Keras optimizer at batch k*b, "
            "and says whether they agree to float round-off, and which "
            "known causes of a difference the model has."
        ),
    )
    parser.add_argument("model", help="a saved .keras model, compiled")
    parser.add_argument(
        "data", help="an .npz file with arrays x, y (and sample_weight)"
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        required=True,
        help="the micro-batch size b you train with",
    )
    parser.add_argument(
        "--updates",
        type=_positive_int,
        default=20,
        help="windows to compare (default: 20)",
    )
    parser.add_argument(
        "--weigh-micro-batches",
        action="store_true",
        help="you call weigh_micro_batches(model) (it is not saved)",
    )
    parser.add_argument(
        "--flush",
        action="store_true",
        help="you train with the FlushAccumulation callback",
    )
    return parser.parse_args(argv)


def main(argv=None):
    """Runs the check; returns the exit status (see the module docstring).

    Args:
        argv: the command line's arguments, `sys.argv[1:]` by default.
    """
    args = parse_args(argv)
    try:
        model, arrays = _load(args)
    except UsageError as error:
        # Collapsed to one line: a CI log greps it.
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return USAGE_ERROR
    try:
        report = check_exactness(model, **arrays, **_options(args))
    except Exception:
        # Whatever it is, it is not a drift: a CI job reads 1 as one.
        traceback.print_exc()
        print(f"{PROG}: error: the check failed in training", file=sys.stderr)
        return FAILED
    return EXACT if report.exact else DRIFTS


def _options(args):
    return dict(
        batch_size=args.batch_size,
        updates=args.updates,
        callbacks=[FlushAccumulation()] if args.flush else None,
    )


def _load(args):
    """`(model, arrays)` read from `args`' files and checked as
    `check_exactness` checks them; raises `UsageError` if they cannot be."""
    model = _load_model(args.model)
    arrays = _load_data(args.data)
    try:
        if args.weigh_micro_batches:
            weigh_micro_batches(model)
        check_arguments(
            model, **arrays, batch_size=args.batch_size, updates=args.updates
        )
    except ValueError as error:
        raise UsageError(error) from None
    return model, arrays


def _load_model(path):
    _check_file("model", path)
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        # (Keras says "File not found" of such a file.)
        raise UsageError(f"model={path!r} is not a .keras (zip) file")
    try:
        return keras.saving.load_model(path)
    except Exception as error:
        # Whatever Keras raises, the file is what is wrong.
        raise UsageError(
            f"model={path!r} is not a saved Keras model: {error}"
        ) from None


def _load_data(path):
    """`{"x": ..., "y": ..., "sample_weight": ...}` from an `.npz` file."""
    _check_file("data", path)
    if not zipfile.is_zipfile(path):
        # (numpy would try to unpickle it.)
        raise UsageError(
            f"data={path!r} is not an .npz file (a zip archive of arrays "
            "that `numpy.savez` writes)"
        )
    try:
        with np.load(path) as data:
            names = sorted(data.files)
            arrays = {name: data[name] for name in _ARRAYS if name in names}
    except Exception as error:
        # Whatever numpy raises, the file is what is wrong.
        raise UsageError(
            f"data={path!r} could not be read as an .npz file: {error}"
        ) from None
    missing = [name for name in ("x", "y") if name not in arrays]
    if missing:
        raise UsageError(
            f"data={path!r} has no array {missing[0]!r}; it holds {names}"
        )
    return arrays


def _one_line(error):
    return " ".join(str(error).split())


def _check_file(name, path):
    if not os.path.exists(path):
        raise UsageError(f"{name}={path!r}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{name}={path!r} is a directory, not a file")


if __name__ == "__main__":
    sys.exit(main())
