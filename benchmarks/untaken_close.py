"""TensorFlow without XLA: what the window's close costs the calls that do
not take it.

    KERAS_BACKEND=tensorflow python -m benchmarks.untaken_close
        [--workload mlp] [--builds 3] [--windows 120]

Builds Adam with `accum_iters=4` as it is; the same with the close's
branch traced empty (a window that never updates: only its calls 1-3 are
comparable); the add-only ceiling; and Keras' built-in
`gradient_accumulation_steps=4`, each `--builds` times, since two builds
of one configuration differ by up to 0.2 ms per call where their buffers
lie. Times Keras' `train_step` compiled as `fit` compiles it, call by
call, every build alternating in one process (`window_steps.profile`),
and prints per build the mean of the median ms of calls 1-3 (those that
do not close the window), the median over the builds, and ours' calls 1-3
less those of the empty branch: what the conditional costs where it is not
taken.
"""

import argparse
import contextlib
import os
import statistics

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks import window_steps  # noqa: E402
from benchmarks import worker  # noqa: E402
from benchmarks import workloads  # noqa: E402

# (name, the configuration it builds, whether its close's branch is empty)
CONFIGS = (
    ("ours", "ours_k4", False),
    ("ours, close's branch empty", "ours_k4", True),
    ("add-only ceiling", "ceiling", False),
    ("Keras' built-in", "keras_builtin_k4", False),
)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workload", default="mlp", choices=workloads.WORKLOADS
    )
    parser.add_argument("--builds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=120)
    args = parser.parse_args(argv)
    for name in ("builds", "windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, not {getattr(args, name)}")
    return args


@contextlib.contextmanager
def _empty_close():
    """While a step is traced: ours' close is a function that does nothing,
    so that its branch holds nothing."""
    from accum_optimizers._backend import tensorflow

    compiled_close = tensorflow.compiled_close
    tensorflow.compiled_close = lambda close, window, jit: lambda: None
    try:
        yield
    finally:
        tensorflow.compiled_close = compiled_close


def built_step(workload, config, empty_close):
    """One synchronous `train_step` of `config` on `workload`, traced."""
    tracing = _empty_close() if empty_close else contextlib.nullcontext()
    with tracing:
        step, _ = window_steps.compiled_step(workload, config, "adam")
        for _ in range(worker.K):  # traced now, as patched; a whole window
            step()
    return step


def calls_before_close(workload, builds, windows):
    """`{name: [ms of calls 1-3, per build]}`, every build alternating."""
    steps = {
        (name, build): built_step(workload, config, empty)
        for build in range(builds)
        for name, config, empty in CONFIGS
    }
    ms = window_steps.profile(steps, windows)
    return {
        name: [
            statistics.fmean(ms[name, build][: worker.K - 1])
            for build in range(builds)
        ]
        for name, _, _ in CONFIGS
    }


def main(argv=None):
    import keras

    args = parse(argv)
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("untaken_close needs KERAS_BACKEND=tensorflow")
    by_build = calls_before_close(args.workload, args.builds, args.windows)
    print(
        f"{args.workload}, Adam k={worker.K}, tf.function: ms per call that "
        "does not close the window"
    )
    print("| configuration | by build | median |")
    print("|---|---|---|")
    medians = {}
    for name, ms in by_build.items():
        medians[name] = statistics.median(ms)
        cells = ", ".join(f"{m:.2f}" for m in ms)
        print(f"| {name} | {cells} | {medians[name]:.2f} |")
    untaken = medians["ours"] - medians["ours, close's branch empty"]
    print(f"the close's branch, not taken: {untaken:+.2f} ms per call")


if __name__ == "__main__":
    main()
