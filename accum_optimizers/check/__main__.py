"""`python -m accum_optimizers.check model.keras data.npz --batch-size 8`:
`check_exactness` on a saved model and a data file.

The `.npz` file holds arrays `x` and `y`, and optionally `sample_weight`.
The model is loaded with `keras.saving.load_model`, compiled as it was
saved, optimizer included. Exits with status 0 when the run is exact, 1
when it drifts, 2 on a usage error.
"""

import argparse
import sys

import keras
import numpy as np

from accum_optimizers.callbacks import FlushAccumulation
from accum_optimizers.check import check_exactness
from accum_optimizers.weighting import weigh_micro_batches


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m accum_optimizers.check",
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
    args = parse_args(argv)
    model = keras.saving.load_model(args.model)
    if args.weigh_micro_batches:
        weigh_micro_batches(model)
    with np.load(args.data) as data:
        missing = {"x", "y"} - set(data.files)
        if missing:
            print(
                f"{args.data} has no array {sorted(missing)[0]!r}; it holds "
                f"{sorted(data.files)}",
                file=sys.stderr,
            )
            return 2
        arrays = {name: data[name] for name in data.files}
    report = check_exactness(
        model,
        arrays["x"],
        arrays["y"],
        sample_weight=arrays.get("sample_weight"),
        batch_size=args.batch_size,
        updates=args.updates,
        callbacks=[FlushAccumulation()] if args.flush else None,
    )
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main())
