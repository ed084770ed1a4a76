"""Time to accuracy on real data: samples and updates to the small batch's
final validation accuracy.

    KERAS_BACKEND=jax python -m benchmarks.time_to_accuracy [--seeds 3]
        [--tasks digits mnist1d] [--epochs N] [--batch B --lr0 LR]
        [--smoke] [--out DIR]

Trains an MLP (64 or 40 inputs, 128-128-10) on scikit-learn's digits
(stratified 80/20 split, seed 0) and on MNIST-1D (Greydanus 2020, generated
by the `mnist1d` package: 4,000 train, 1,000 test) with `SGDAccumulate`
(momentum 0.9) on micro-batches of b, the same samples for each of five
configurations: `small` (accum_iters=1, the parent SGD), `k16` (16
micro-batches a window, lr0), `k16_linear` (16 lr0), `by_noise_scale`
(window from the measured noise scale, 2 to 64 micro-batches, lr0) and
`by_noise_scale_adascale` (the same with `schedules.adascale(lr0, b)`).
Validation accuracy is read a few times an epoch. The target is the mean
over seeds of `small`'s final validation accuracy, less 0.5 points; for
each configuration, the samples and updates to first reach it, over seeds.
Writes `results.md` and `results.json` (every curve) to
`benchmarks/results/time_to_accuracy/` and `docs/img/time-to-accuracy.png`
(all three to `--out DIR` when given; `--smoke` writes only there).
"""

import argparse
import json
import os
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import accum_optimizers as ao  # noqa: E402

CONFIGS = "small k16 k16_linear by_noise_scale by_noise_scale_adascale".split()
# b, lr0 (the best final accuracy of `small` over 0.005-0.1 at b = 16 on
# digits, 32 on MNIST-1D; on digits b = 8 with lr0 halved, a batch further
# below the noise scale, where a bigger one has more updates to save),
# epochs (the small batch on its plateau well before the end), evaluations
# per epoch.
TASKS = {
    "digits": dict(batch=8, lr0=0.025, epochs=30, evals=4),
    "mnist1d": dict(batch=32, lr0=0.03, epochs=60, evals=2),
}
TOLERANCE = 0.005


def load(task):
    """`(x, y, x_val, y_val)` of a task, float32 and int32."""
    if task == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x, x_val, y, y_val = train_test_split(
            x / 16.0, y, test_size=0.2, stratify=y, random_state=0
        )
    else:
        from mnist1d.data import get_dataset_args
        from mnist1d.data import make_dataset

        data = make_dataset(get_dataset_args())
        x, y, x_val, y_val = (data[k] for k in ("x", "y", "x_test", "y_test"))
    types = ("float32", "int32") * 2
    return tuple(np.asarray(a, t) for a, t in zip((x, y, x_val, y_val), types))


def optimizer(config, lr0, batch):
    """The `SGDAccumulate` of one configuration."""
    if not config.startswith("by_noise_scale"):
        k = 1 if config == "small" else 16
        lr = 16 * lr0 if config == "k16_linear" else lr0
        return ao.SGDAccumulate(lr, momentum=0.9, accum_iters=k)
    if config.endswith("adascale"):
        lr0 = ao.schedules.adascale(lr0, base_batch_size=batch)
    windows = ao.schedules.by_noise_scale(batch, floor=2, ceiling=64)
    return ao.SGDAccumulate(
        lr0, momentum=0.9, accum_iters=windows, measure_noise_scale=True
    )


class Curve(keras.callbacks.Callback):
    """Reads validation accuracy `evals` times an epoch into `points`."""

    def __init__(self, x_val, y_val, train_size, batch, evals):
        super().__init__()
        self.x_val, self.y_val = x_val, y_val
        self.train_size, self.batch = train_size, batch
        steps = -(-train_size // batch)
        self.at = {round(steps * (i + 1) / evals) - 1 for i in range(evals)}
        self.epoch, self.points = 0, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if batch not in self.at:
            return
        if hasattr(self.model, "jax_state_sync"):
            self.model.jax_state_sync()  # JAX keeps the state off the model
        logits = keras.ops.convert_to_numpy(self.model(self.x_val))
        seen = min((batch + 1) * self.batch, self.train_size)
        optimizer = self.model.optimizer
        point = dict(
            samples=self.epoch * self.train_size + seen,
            updates=int(optimizer.iterations),
            val_accuracy=float(np.mean(logits.argmax(-1) == self.y_val)),
        )
        for name in ("noise_scale", "adascale_gain", "scale_invariant_step"):
            value = float(getattr(optimizer, name, "nan"))
            if not np.isnan(value):  # NaN: not measured, or no AdaScale
                point[name] = value if np.isfinite(value) else None
        self.points.append(point)


def train(config, data, settings, epochs, seed):
    """The curve of one run: a point per evaluation."""
    x, y, x_val, y_val = data
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(128, activation="relu") for _ in range(2)]
    model = keras.Sequential([keras.Input(x.shape[1:]), *layers])
    model.add(keras.layers.Dense(10))
    model.compile(
        optimizer=optimizer(config, settings["lr0"], settings["batch"]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    if config.startswith("by_noise_scale"):
        ao.weigh_micro_batches(model)  # the noise scale counts samples
    curve = Curve(x_val, y_val, len(x), settings["batch"], settings["evals"])
    fit = dict(batch_size=settings["batch"], shuffle=True, verbose=0)
    model.fit(
        x, y, epochs=epochs or settings["epochs"], callbacks=[curve], **fit
    )
    return curve.points


def curves(runs, task, config):
    """The curves of one task and configuration, a seed each."""
    return [
        r["curve"] for r in runs if (r["task"], r["config"]) == (task, config)
    ]


def summarize(task, runs):
    """The target, and a row a configuration: `(samples, updates)` to the
    target per seed (None: not reached) and the ratios to `small`'s."""
    small = [c[-1]["val_accuracy"] for c in curves(runs, task, "small")]
    target = float(np.mean(small)) - TOLERANCE
    rows, base = [], None
    for config in CONFIGS:
        seeds = curves(runs, task, config)
        hits = [first(c, target) for c in seeds]
        final = [c[-1]["val_accuracy"] for c in seeds]
        rows.append(dict(task=task, config=config, hits=hits, final=final))
        if hits and None not in hits:
            samples, updates = np.mean(hits, 0)
            rows[-1].update(samples=samples, updates=updates)
            base = rows[-1] if config == "small" else base
        if base and "samples" in rows[-1]:
            rows[-1]["samples_ratio"] = samples / base["samples"]
            rows[-1]["updates_ratio"] = base["updates"] / updates
    return target, rows


def first(points, target):
    """`(samples, updates)` at the first point at or above `target`."""
    hits = (p for p in points if p["val_accuracy"] >= target)
    return next(((p["samples"], p["updates"]) for p in hits), None)


def spread(values, digits=0):
    """`mean [min-max]` of some values."""
    low, mean, high = min(values), np.mean(values), max(values)
    return f"{mean:,.{digits}f} [{low:,.{digits}f}-{high:,.{digits}f}]"


def cells(row):
    """A row of the table, after its task and configuration."""
    hits = [h for h in row["hits"] if h]
    out = [f"{len(hits)}/{len(row['hits'])}"]
    out += [
        spread([h[i] for h in hits]) if hits else "not reached" for i in (0, 1)
    ]
    out += [
        f"{row[k]:.2f}" if k in row else "-"
        for k in ("samples_ratio", "updates_ratio")
    ]
    return out + [spread([100 * f for f in row["final"]], 1)]


def table(targets, rows):
    """The markdown table, and what it means."""
    lines = [
        "| task | config | reached | samples to target | updates to target "
        "| samples ratio | updates ratio | final val acc % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            "| " + " | ".join([row["task"], row["config"], *cells(row)]) + " |"
        )
    reached = ", ".join(f"{t} {100 * v:.2f}%" for t, v in targets.items())
    return "\n".join(lines) + (
        f"\n\nTarget: the mean over seeds of `small`'s final validation "
        f"accuracy less {100 * TOLERANCE:.1f} points ({reached}). Mean "
        "[min-max] over the seeds that reach it; ratios where every seed "
        "does. samples ratio = samples / small's samples to the target; "
        "updates ratio = small's updates / updates."
    )


def plot(runs, targets, path):
    """Validation accuracy against samples and updates, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = (11, 4 * len(targets))
    figure, axes = plt.subplots(len(targets), 2, figsize=size, squeeze=False)
    for task, row in zip(targets, axes):
        for config in CONFIGS:
            seeds = curves(runs, task, config)
            n = min((len(c) for c in seeds), default=0)
            mean = {
                k: np.mean([[p[k] for p in c[:n]] for c in seeds], 0)
                for k in ("samples", "updates", "val_accuracy")
            }
            for side, key in zip(row, ("samples", "updates")):
                if seeds:
                    side.plot(mean[key], mean["val_accuracy"], label=config)
        for side, key in zip(row, ("samples", "updates")):
            side.axhline(targets[task], color="gray", ls="--", label="target")
            side.set(
                xlabel=f"{key} (mean over seeds)",
                ylabel="validation accuracy",
                title=f"{task}: accuracy against {key}",
                ylim=(0.5 if task == "digits" else 0.3, 1),
            )
        row[1].set_xscale("log")
        row[1].legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def run_task(task, args, configs):
    """The runs of one task: a record a configuration and seed."""
    settings, data = TASKS[task], load(task)
    if args.smoke:  # a subset
        data = (data[0][:256], data[1][:256], data[2][:128], data[3][:128])
    runs = []
    for config in configs:
        for seed in range(args.seeds):
            tic = time.time()
            curve = train(config, data, settings, args.epochs, seed)
            wall = round(time.time() - tic, 2)
            runs.append(dict(task=task, config=config, seed=seed, wall_s=wall))
            runs[-1]["curve"] = curve
            final = curve[-1]["val_accuracy"]
            print(f"{task} {config} seed {seed}: {final:.4f}, {wall} s")
    return runs


def write(args, report):
    """Writes the table, the JSON and the picture."""
    out = args.out or os.path.join("benchmarks", "results", "time_to_accuracy")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as file:
        file.write(report["table"] + "\n")
    with open(os.path.join(out, "results.json"), "w") as file:
        json.dump(report, file, indent=1)
    picture = args.out or os.path.join("docs", "img")
    picture = os.path.join(picture, "time-to-accuracy.png")
    plot(report["runs"], report["targets"], picture)
    print(f"wrote {out}/results.{{md,json}} and {picture}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, help="default: per task")
    parser.add_argument("--batch", type=int, help="b, default: per task")
    parser.add_argument("--lr0", type=float, help="default: per task")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", help="a folder for all three files")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seeds, args.epochs = 1, args.epochs or 2
    # A window pending at the end of `fit` stays pending: the curves are
    # read before it, and the warning would repeat once per run.
    warnings.filterwarnings("ignore", message="Training ended with")
    for task in args.tasks:
        for name in ("batch", "lr0"):
            if getattr(args, name) is not None:
                TASKS[task] = dict(TASKS[task], **{name: getattr(args, name)})
    configs = CONFIGS
    started, runs, rows, targets = time.time(), [], [], {}
    for task in args.tasks:
        runs += run_task(task, args, configs)
        targets[task], task_rows = summarize(task, runs)
        rows += task_rows
    wall = time.time() - started
    text = table(targets, rows)
    print(f"\n{text}\n\nwall time: {wall:.0f} s")
    if args.out or not args.smoke:
        settings = dict(vars(args), tasks={t: TASKS[t] for t in args.tasks})
        settings.update(tolerance=TOLERANCE, wall_s=round(wall, 1))
        settings["backend"] = keras.backend.backend()
        report = dict(settings=settings, targets=targets, table=text)
        write(args, dict(report, summary=rows, runs=runs))


if __name__ == "__main__":
    main()
