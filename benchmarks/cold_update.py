"""What the parent's update costs when its state has gone cold.

    KERAS_BACKEND=torch python -m benchmarks.cold_update [--calls 300]
    KERAS_BACKEND=tensorflow python -m benchmarks.cold_update

An accumulating optimizer runs the parent's update once per window, after
`accum_iters - 1` micro-steps whose forward and backward passes have pushed
the optimizer state and the weights out of the CPU caches; the parent runs
it every step, on state its previous step just touched. This times the
parent's `apply` (Adam, SGD with momentum, RMSprop) on the MLP's variable
shapes (1.3 M parameters) back to back, and after touching `--touch` MiB of
other memory between calls (default 16, 64 and 256). ms per call, median of
`--calls`. torch runs `apply` eagerly (Keras' fused update), TensorFlow in a
`tf.function`.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import worker  # noqa: E402

SHAPES = [(256, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]


def _apply_fn(optimizer_name):
    """Returns a zero-argument call of the parent's `apply`."""
    parent, _, options = worker.OPTIMIZERS[optimizer_name]
    rng = np.random.default_rng(0)
    variables = [
        keras.Variable(rng.normal(size=s).astype("float32") * 0.01)
        for s in SHAPES
    ]
    grads = [
        keras.ops.convert_to_tensor(rng.normal(size=s).astype("float32"))
        for s in SHAPES
    ]
    optimizer = parent(**options)
    optimizer.build(variables)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(lambda: optimizer.apply(grads, variables))
    return lambda: optimizer.apply(grads, variables)


def time_calls(apply, calls, touched=None):
    for _ in range(max(calls // 10, 2)):
        apply()
    times = []
    for _ in range(calls):
        if touched is not None:
            np.add(touched, 1.0, out=touched)
        start = time.perf_counter()
        apply()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--touch", type=int, nargs="+", default=[16, 64, 256], metavar="MIB"
    )
    parser.add_argument(
        "--optimizers", nargs="+", default=list(worker.OPTIMIZERS)
    )
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    if backend not in ("torch", "tensorflow"):
        parser.error(f"needs torch or tensorflow, not {backend}")
    print(f"{backend}: the parent's update, ms per call")
    touch = " | ".join(f"after {m} MiB" for m in args.touch)
    print(f"| optimizer | back to back | {touch} |")
    print("|---|---|" + "---|" * len(args.touch))
    for optimizer_name in args.optimizers:
        apply = _apply_fn(optimizer_name)
        cells = [time_calls(apply, args.calls)]
        for mib in args.touch:
            touched = np.zeros(mib * 2**20 // 4, dtype="float32")
            cells.append(time_calls(apply, args.calls, touched))
        print(
            f"| {optimizer_name} | "
            + " | ".join(f"{c:.2f}" for c in cells)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
