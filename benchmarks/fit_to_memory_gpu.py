"""`fit_to_memory` on a GPU with real out-of-memory errors: one command.

    python -m benchmarks.fit_to_memory_gpu [--backends jax tensorflow torch]
                                           [--memory-gib 4] [--target 32768]
                                           [--squeeze-after 6] [--micro-batch 0]
                                           [--smoke]

For each backend, in its own process with the device's memory capped at
`--memory-gib` (JAX: `XLA_PYTHON_CLIENT_MEM_FRACTION`; TensorFlow: a
logical device with that `memory_limit`; torch:
`set_per_process_memory_fraction`), an MLP whose train step at the target
batch does not fit the cap is planned by out-of-memory probes and trained
for one epoch with `fit_to_memory` (`AdamAccumulate`). On torch, with
`--squeeze-after N`, the cap is halved after N micro-steps: a real
out-of-memory error mid-epoch, which `fit_to_memory` recovers from. Then,
in another process without the cap, Keras' `Adam` trains the same model
at `batch_size=target` on the same data. Printed per backend: the chosen
micro-batch, `accum_iters`, the peak measured, the probes, the
recoveries, the seconds, and the largest weight difference to the parent
(absolute, and relative to the largest weight).

`--micro-batch B` starts from `B` instead of planning. `--smoke` runs a
tiny model from a micro-batch of 24 for a target of 64 on whatever device
there is (on a CPU nothing runs out of memory), to check the command.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOKE = {
    "width": 64,
    "depth": 2,
    "inputs": 32,
    "target": 64,
    "samples": 160,
    "micro_batch": 24,
}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backends", nargs="+", default=["jax", "tensorflow", "torch"]
    )
    parser.add_argument("--memory-gib", type=float, default=4.0)
    parser.add_argument("--target", type=int, default=32768)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--inputs", type=int, default=1024)
    parser.add_argument("--squeeze-after", type=int, default=0)
    parser.add_argument("--micro-batch", type=int, default=0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    if parser.parse_args(argv).smoke:
        parser.set_defaults(**SMOKE)
    return parser.parse_args(argv)


# -- The workers (one backend and one run each, in its own process) --------


def total_gpu_bytes():
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return int(out.split()[0]) * 2**20


def cap_memory(backend, gib):
    """Caps the device memory this process may use (before Keras starts)."""
    total = total_gpu_bytes()
    if total is None or not gib:
        return
    fraction = min(1.0, gib * 2**30 / total)
    if backend == "jax":
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    elif backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.set_logical_device_configuration(
                gpus[0],
                [
                    tf.config.LogicalDeviceConfiguration(
                        memory_limit=int(gib * 1024)
                    )
                ],
            )
    else:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(fraction)


def build(args):
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((args.inputs,))])
    for _ in range(args.depth):
        model.add(keras.layers.Dense(args.width, activation="relu"))
    model.add(keras.layers.Dense(10))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.inputs)).astype("float32")
    y = rng.integers(0, 10, size=args.samples).astype("int32")
    return model, x, y


def squeezer(fraction, after):
    """torch: halves the memory cap after `after` micro-steps."""
    import keras
    import torch

    class Squeeze(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            Squeeze.steps += 1
            if Squeeze.steps == after:
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(fraction / 2)

    return Squeeze()


def worker(args):
    backend = args.worker.split(":")[0]
    run = args.worker.split(":")[1]
    if run == "ours":
        cap_memory(backend, args.memory_gib)
    import keras
    import numpy as np

    import accum_optimizers

    model, x, y = build(args)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    result = {"backend": backend, "run": run}
    start = time.perf_counter()
    if run == "parent":
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss)
        model.fit(x, y, batch_size=args.target, shuffle=False, verbose=0)
    else:
        model.compile(
            optimizer=accum_optimizers.AdamAccumulate(1e-4), loss=loss
        )
        callbacks = []
        total = total_gpu_bytes()
        if backend == "torch" and args.squeeze_after and total:
            fraction = min(1.0, args.memory_gib * 2**30 / total)
            callbacks.append(squeezer(fraction, args.squeeze_after))
        history = accum_optimizers.fit_to_memory(
            model,
            x,
            y,
            target_batch_size=args.target,
            micro_batch_size=args.micro_batch or None,
            shuffle=False,
            callbacks=callbacks,
            verbose=0,
        )
        plan = history.plan
        result.update(
            micro_batch_size=plan.micro_batch_size,
            accum_iters=plan.accum_iters,
            peak_bytes=plan.peak_bytes,
            probes=plan.probes,
            recoveries=plan.recoveries,
            loss=history.history["loss"],
        )
    result["seconds"] = time.perf_counter() - start
    np.savez(args.out + ".npz", *model.get_weights())
    Path(args.out + ".json").write_text(json.dumps(result))


# -- The command -------------------------------------------------------------


def run_worker(backend, run, args, folder, timeout=None):
    """Runs one worker (`run`: "ours" or "parent") for `backend`, killed
    after `timeout` seconds (`subprocess.TimeoutExpired`); returns its
    result and final weights, or `({"error": ...}, None)`."""
    out = str(Path(folder) / f"{backend}-{run}")
    flags = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in (
            "memory_gib",
            "target",
            "samples",
            "width",
            "depth",
            "inputs",
            "squeeze_after",
            "micro_batch",
        )
    ]
    env = dict(
        os.environ,
        KERAS_BACKEND=backend,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    )
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.fit_to_memory_gpu", *flags]
        + ["--worker", f"{backend}:{run}", "--out", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if completed.returncode:
        return {"error": completed.stderr[-2000:]}, None
    import numpy as np

    weights = np.load(out + ".npz")
    return json.loads(Path(out + ".json").read_text()), [
        weights[k] for k in weights.files
    ]


def check_backend(backend, args, timeout=None):
    """`fit_to_memory` (capped) and the parent (uncapped) on `backend`, each
    in its own process; returns the row `report` prints.

    Args:
        backend: a Keras backend name.
        args: the options, as `parse` returns them.
        timeout: seconds both processes together may take, or `None`; past
            it, `subprocess.TimeoutExpired`.
    """
    import numpy as np

    deadline = None if timeout is None else time.monotonic() + timeout

    def left():
        return None if deadline is None else max(1, deadline - time.monotonic())

    with tempfile.TemporaryDirectory() as folder:
        ours, our_weights = run_worker(backend, "ours", args, folder, left())
        parent, parent_weights = run_worker(
            backend, "parent", args, folder, left()
        )
    row = {"backend": backend, "ours": ours, "parent": parent}
    if our_weights is not None and parent_weights is not None:
        row["max_abs_difference"] = max(
            float(np.abs(a - b).max())
            for a, b in zip(our_weights, parent_weights)
        )
        row["largest_weight"] = max(
            float(np.abs(b).max()) for b in parent_weights
        )
    return row


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    rows = []
    for backend in args.backends:
        row = check_backend(backend, args)
        rows.append(row)
        print(report(row), flush=True)
    return rows


def report(row):
    ours, parent = row["ours"], row["parent"]
    lines = [f"== {row['backend']}"]
    for name, result in (("fit_to_memory", ours), ("parent", parent)):
        if "error" in result:
            lines.append(f"{name} failed:\n{result['error']}")
    if "error" in ours:
        return "\n".join(lines)
    peak = ours["peak_bytes"]
    lines.append(
        f"micro-batch {ours['micro_batch_size']} x accum_iters "
        f"{ours['accum_iters']}, peak "
        + ("unknown" if peak is None else f"{peak / 2**20:.1f} MiB")
        + f", {ours['seconds']:.1f} s"
    )
    for size, fits, probe_peak in ours["probes"]:
        shown = "-" if probe_peak is None else f"{probe_peak / 2**20:.1f} MiB"
        lines.append(f"  probe {size}: fits={fits} peak={shown}")
    for epoch, sample, size, new in ours["recoveries"]:
        lines.append(
            f"  recovered: epoch {epoch}, sample {sample}: {size} -> {new}"
        )
    if "max_abs_difference" in row:
        relative = row["max_abs_difference"] / row["largest_weight"]
        lines.append(
            "parent at the target batch: "
            f"{parent['seconds']:.1f} s; largest weight difference "
            f"{row['max_abs_difference']:.2e} ({relative:.1e} of the "
            "largest weight)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
