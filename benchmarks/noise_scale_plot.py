"""The gradient noise scale over a real training run, for the docs.

    KERAS_BACKEND=jax python -m benchmarks.noise_scale_plot [--epochs 30]
                                                         [--out PATH]

Trains an MLP on scikit-learn's digits (1,797 8x8 images, 10 classes) with
`AdamAccumulate(accum_iters=4, measure_noise_scale=True)` on micro-batches
of 16 (the batch the user chose: 64; shuffled, seed 0), windows weighed
by their samples
(`weigh_micro_batches`), so the noise scale is counted in samples. A second
run lets `schedules.by_noise_scale` choose the window. Plots each run's
`noise_scale` per update (`AccumulationLogger(update_freq="batch")`), the
chosen batch and the batch the schedule chose, and writes the PNG
(default `docs/img/noise-scale-digits.png`) and prints a summary.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import accum_optimizers as ao  # noqa: E402

MICRO_BATCH, ACCUM_ITERS = 16, 4


def digits():
    """The digits, scaled to [0, 1], shuffled once (seed 0)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    return (x[order] / 16.0).astype("float32"), y[order].astype("int32")


def train(accum_iters, epochs, seed=0):
    """Returns the logger's `windows` of one run."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=ao.AdamAccumulate(
            learning_rate=1e-3,
            accum_iters=accum_iters,
            measure_noise_scale=True,
            noise_scale_momentum=0.95,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ao.weigh_micro_batches(model)
    logger = ao.AccumulationLogger(update_freq="batch")
    x, y = digits()
    model.fit(
        x,
        y,
        batch_size=MICRO_BATCH,
        epochs=epochs,
        verbose=0,
        callbacks=[logger],
    )
    return logger.windows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--out",
        default=os.path.join("docs", "img", "noise-scale-digits.png"),
    )
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = train(ACCUM_ITERS, args.epochs)
    grown = train(
        ao.schedules.by_noise_scale(MICRO_BATCH, floor=2, ceiling=64),
        args.epochs,
    )
    samples = len(digits()[0])
    seen = np.asarray([0.0] + grown["samples_seen"])
    chosen = np.diff(seen)
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(
        np.asarray(fixed["samples_seen"]) / samples,
        fixed["noise_scale"],
        label="B_simple, fixed batch 64",
    )
    axes.plot(
        seen[1:] / samples,
        grown["noise_scale"],
        label="B_simple, by_noise_scale run",
        alpha=0.8,
    )
    axes.step(
        seen[1:] / samples,
        chosen,
        where="post",
        label="batch by_noise_scale chose",
        color="tab:green",
    )
    axes.axhline(
        MICRO_BATCH * ACCUM_ITERS,
        color="gray",
        linestyle="--",
        label="batch chosen by hand (16 x 4)",
    )
    axes.set_yscale("log")
    axes.set_xlabel("epochs (samples seen / 1,797)")
    axes.set_ylabel("samples")
    axes.set_title("Gradient noise scale, MLP on digits (AdamAccumulate)")
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    finite = np.asarray(fixed["noise_scale"], "float64")
    finite = finite[np.isfinite(finite)]
    print(
        f"fixed batch 64: {len(fixed['updates'])} updates, B_simple from "
        f"{finite[0]:.0f} to {finite[-1]:.0f} samples "
        f"(median {np.median(finite):.0f})"
    )
    print(
        f"by_noise_scale: {len(grown['updates'])} updates, batch from "
        f"{chosen[0]:.0f} to {chosen[-1]:.0f}; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
