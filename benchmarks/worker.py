"""One benchmark process: one Keras backend (and mode), side-by-side timing.

Run by `benchmarks/run.py`; prints one JSON object per line. Two jobs:

- `--time`: for each workload and optimizer, builds every configuration from
  the same initial weights, warms each up (compilation, both branches of the
  window gate), then runs `--repeats` interleaved rounds (the order rotates
  every round) of `steps` micro-batches each, and reports the median
  micro-batch samples/s of every configuration, with its optimizer state
  bytes.
- `--memory CONFIG`: a fresh process trains one configuration and reports its
  process peak RSS (VmHWM), so configurations do not share a peak.

Two modes run on 2 replicas: `tensorflow-mirrored` (a `MirroredStrategy`
over 2 logical CPU devices, made before TensorFlow starts) and
`jax-dataparallel` (`keras.distribution.DataParallel` over 2 host devices;
`run.py` sets `XLA_FLAGS`). There the micro-batch b is per replica, the
figures count the global micro-batch (2b) samples, and the ceiling is not
run (its add-only buffers are not replica-local).
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time

REPLICAS = 2
DISTRIBUTED_MODES = ("tensorflow-mirrored", "jax-dataparallel")
if "tensorflow-mirrored" in sys.argv:
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * REPLICAS,
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_optimizers import AdamAccumulate  # noqa: E402
from accum_optimizers import AdamWAccumulate  # noqa: E402
from accum_optimizers import LionAccumulate  # noqa: E402
from accum_optimizers import RMSpropAccumulate  # noqa: E402
from accum_optimizers import SGDAccumulate  # noqa: E402
from benchmarks import workloads  # noqa: E402
from benchmarks.after_backward import after_backward  # noqa: E402
from benchmarks.ceiling import AddOnly  # noqa: E402

K = 4
OPTIMIZERS = {
    "adam": (keras.optimizers.Adam, AdamAccumulate, {}),
    "sgd_momentum": (
        keras.optimizers.SGD,
        SGDAccumulate,
        {"learning_rate": 0.01, "momentum": 0.9},
    ),
    "rmsprop": (keras.optimizers.RMSprop, RMSpropAccumulate, {}),
    "adamw": (keras.optimizers.AdamW, AdamWAccumulate, {}),
    "lion": (
        keras.optimizers.Lion,
        LionAccumulate,
        {"learning_rate": 1e-4},
    ),
}
CONFIGS = [
    "parent",
    "keras_builtin_k4",
    "ours_k4",
    "ours_k1",
    "ceiling",
    "parent_4b",
]
# Timed only when asked (`--configs`): the features' cost.
FEATURE_CONFIGS = ["ours_k4_skip", "ours_k4_noise", "ours_k4_skip_noise"]


def make_config(config, optimizer_name):
    """Returns `(optimizer, batch size multiplier)` for a configuration."""
    parent, ours, options = OPTIMIZERS[optimizer_name]
    if config == "parent":
        return parent(**options), 1
    if config == "keras_builtin_k4":
        return parent(gradient_accumulation_steps=K, **options), 1
    if config == "keras_builtin_k4_after_backward":
        waiting = after_backward(parent)
        return waiting(gradient_accumulation_steps=K, **options), 1
    if config == "ours_k4":
        return ours(accum_iters=K, **options), 1
    if config == "ours_k4_skip":
        return ours(accum_iters=K, skip_nonfinite=True, **options), 1
    if config == "ours_k4_noise":
        return ours(accum_iters=K, measure_noise_scale=True, **options), 1
    if config == "ours_k4_skip_noise":
        return (
            ours(
                accum_iters=K,
                skip_nonfinite=True,
                measure_noise_scale=True,
                **options,
            ),
            1,
        )
    if config == "ours_k1":
        return ours(accum_iters=1, **options), 1
    if config == "ceiling":
        return AddOnly(), 1
    if config == "parent_4b":
        return parent(**options), K
    raise ValueError(f"Unknown configuration: {config!r}")


def state_bytes(optimizer):
    return int(
        sum(
            np.prod(v.shape) * np.dtype(v.dtype).itemsize
            for v in optimizer.variables
        )
    )


def strategy_scope(mode):
    """Makes the scope models are built in: a 2-replica strategy's, or none."""
    if mode == "tensorflow-mirrored":
        import tensorflow as tf

        devices = [f"/cpu:{i}" for i in range(REPLICAS)]
        return tf.distribute.MirroredStrategy(devices).scope
    return contextlib.nullcontext


def configs_for(mode):
    if mode in DISTRIBUTED_MODES:
        return [c for c in CONFIGS if c != "ceiling"]
    return CONFIGS


def compiled_model(workload, config, optimizer_name, jit_compile, scope):
    with scope():
        model = workloads.build(workload)
        optimizer, multiplier = make_config(config, optimizer_name)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
    return model, multiplier


class _TrainingClock(keras.callbacks.Callback):
    """Times `fit` from `on_train_begin` to `on_train_end`.

    Leaves out what `fit` does around the training loop: on TensorFlow its
    teardown took 12 ms or, in about one call in three and whatever the
    optimizer, 250 ms (after `on_train_end`; MLP, 96 micro-steps of 3.7 ms
    either way), which made a round's rate bimodal. On JAX it first waits
    for the dispatched steps to finish.
    """

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_train_end(self, logs=None):
        if keras.backend.backend() == "jax":
            import jax

            jax.block_until_ready(
                [v.value for v in self.model.variables]
                + [v.value for v in self.model.optimizer.variables]
            )
        self.seconds = time.perf_counter() - self.start


def train_seconds(model, x, y, batch_size):
    """Seconds `model.fit` spends in its training loop over `x`, `y`."""
    clock = _TrainingClock()
    model.fit(
        x, y, batch_size=batch_size, shuffle=False, verbose=0, callbacks=[clock]
    )
    return clock.seconds


def time_group(
    workload,
    optimizer_name,
    mode,
    jit_compile,
    repeats,
    smoke,
    only=None,
    build_shift=0,
):
    """Times every configuration of `workload` and `optimizer_name` (or
    those in `only`), side by side; yields one record per configuration.
    The configurations are built in their order rotated by `build_shift`:
    where a model's buffers lie depends on what was built before it, and
    two builds of one model differ by a few percent."""
    micro_batch, steps, smoke_steps = workloads.WORKLOADS[workload]
    steps = smoke_steps if smoke else steps
    if mode in DISTRIBUTED_MODES:
        micro_batch *= REPLICAS
    x, y = workloads.data(workload, steps * micro_batch)
    runs, failed = {}, {}
    configs = configs_for(mode) + FEATURE_CONFIGS
    configs = [c for c in configs if c in (only or configs_for(mode))]
    scope = strategy_scope(mode)
    shift = build_shift % len(configs)
    for config in configs[shift:] + configs[:shift]:
        model, multiplier = compiled_model(
            workload, config, optimizer_name, jit_compile, scope
        )
        batch = micro_batch * multiplier
        try:  # warm-up: compile, both branches
            train_seconds(model, x, y, batch)
        except Exception as error:  # noqa: BLE001 - reported in the table
            failed[config] = f"{type(error).__name__}: {error}"[:300]
            continue
        runs[config] = (model, batch, [])
    for round_index in range(repeats):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if config in runs:
                model, batch, rates = runs[config]
                rates.append(len(x) / train_seconds(model, x, y, batch))
    for config in configs:
        record = {
            "workload": workload,
            "optimizer": optimizer_name,
            "config": config,
        }
        if config in failed:
            yield {**record, "error": failed[config]}
            continue
        model, batch, rates = runs[config]
        yield {
            **record,
            "batch_size": batch,
            "samples_per_s": statistics.median(rates),
            "repeats": rates,
            "state_bytes": state_bytes(model.optimizer),
            "trainable_count": len(model.trainable_variables),
            "trainable_bytes": int(
                sum(
                    np.prod(v.shape) * np.dtype(v.dtype).itemsize
                    for v in model.trainable_variables
                )
            ),
        }


def peak_rss_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument(
        "--workloads", nargs="+", default=list(workloads.WORKLOADS)
    )
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--memory", choices=CONFIGS)
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS + FEATURE_CONFIGS,
        help="time only these configurations (default: all but the features')",
    )
    parser.add_argument(
        "--build-shift",
        type=int,
        default=0,
        help="build the configurations in their order rotated by this many",
    )
    args = parser.parse_args(argv)
    jit_compile = {"tensorflow-xla": True}.get(
        args.mode, False if args.mode.startswith("tensorflow") else "auto"
    )
    if args.mode == "jax-dataparallel":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(
                devices=keras.distribution.list_devices()[:REPLICAS]
            )
        )
    common = {"mode": args.mode, "backend": keras.backend.backend()}
    if args.memory:
        workload, optimizer_name = args.workloads[0], args.optimizers[0]
        micro_batch, steps, smoke_steps = workloads.WORKLOADS[workload]
        steps = smoke_steps if args.smoke else steps
        x, y = workloads.data(workload, steps * micro_batch)
        model, multiplier = compiled_model(
            workload,
            args.memory,
            optimizer_name,
            jit_compile,
            strategy_scope(args.mode),
        )
        train_seconds(model, x, y, micro_batch * multiplier)
        train_seconds(model, x, y, micro_batch * multiplier)
        record = {
            "workload": workload,
            "optimizer": optimizer_name,
            "config": args.memory,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        print(json.dumps({**common, **record}), flush=True)
        return
    for workload in args.workloads:
        for optimizer_name in args.optimizers:
            for record in time_group(
                workload,
                optimizer_name,
                args.mode,
                jit_compile,
                args.repeats,
                args.smoke,
                args.configs,
                args.build_shift,
            ):
                print(json.dumps({**common, **record}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
