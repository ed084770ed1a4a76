"""Peak memory of one train step, against the bound: one command.

    python -m benchmarks.memory [--modes jax tensorflow-xla tensorflow
                                         tensorflow-mirrored torch]
                                [--workloads mlp transformer] [--smoke]
                                [--mlp-width 2048] [--mlp-depth 5]
                                [--mlp-batch 256] [--transformer-batch 32]
                                [--repeats 3]
                                [--out benchmarks/results/memory]

The bound: an accumulating optimizer holds the parent optimizer's own state
plus one float32 sum per parameter, and nothing else at any moment of the
step. For every backend mode (one process each) and workload, four
configurations of Adam are measured: the parent at the micro-batch `b`,
ours (`AdamAccumulate(accum_iters=4)`) at `b`, Keras' built-in
`gradient_accumulation_steps=4` at `b`, and the parent at `4b` (the batch
that did not fit). The report gives `extra / sums`: the peak over the
parent's at `b`, in units of the sums' bytes (the bound is 1.00).

What each mode measures (what the backend offers):

- `jax`: XLA's memory analysis of Keras' compiled train step, state donated
  as `fit` does: arguments + outputs - aliased + temporaries.
- `tensorflow-xla`: TensorFlow gives the HLO of the train step under
  `tf.function(jit_compile=True)` (`experimental_get_compiler_ir`) but no
  memory analysis of it; that HLO is compiled by jaxlib's XLA (for the
  CPU) and analysed as for JAX.
- `tensorflow`: without XLA the graph runs op by op and nothing analyses
  its memory: the allocator's peak over a warm window
  (`tf.config.experimental.get_memory_info`), on a GPU or the CPU, with
  one op at a time (`set_inter_op_parallelism_threads(1)`).
- `tensorflow-mirrored`: as `tensorflow`, under `MirroredStrategy` over 2
  logical CPU devices (one allocator); each replica holds its own sums,
  so the sums' bytes are counted twice.
- `torch`: the step as `fit` runs it (eagerly), over a warm window: on CUDA
  the allocator's peak (`torch.cuda.max_memory_allocated`); on the CPU,
  whose allocator keeps no statistics, the profiler's allocation and free
  events (`torch.profiler.profile(profile_memory=True)`) summed in time
  order from before the model exists.

A counted row reports the optimizer's variables, the state the bound is
about; a step's transient buffers are not in it.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "jax": "jax",
    "tensorflow-xla": "tensorflow",
    "tensorflow": "tensorflow",
    "tensorflow-mirrored": "tensorflow",
    "torch": "torch",
}
# `tensorflow-mirrored`: replicas on as many logical CPU devices.
REPLICAS = 2
# Modes measured by TensorFlow's allocator, whose peak for the same step
# varies between processes (it counts whole blocks, reused as they fall
# free): `--repeats` processes each, their median reported.
ALLOCATOR_MODES = ("tensorflow", "tensorflow-mirrored")
CONFIGS = ["parent", "ours_k4", "keras_builtin_k4", "parent_4b"]
# Measured on request (`--configs`): ours with a feature.
FEATURE_CONFIGS = {
    "ours_k4_skip": {"skip_nonfinite": True},
    "ours_k4_noise": {"measure_noise_scale": True},
}
# The table's columns, in order: each configuration's `extra / sums`.
COLUMNS = {
    "ours_k4": "ours k=4",
    "ours_k4_skip": "ours k=4 skip",
    "ours_k4_noise": "ours k=4 noise scale",
    "keras_builtin_k4": "Keras k=4",
    "parent_4b": "parent 4b",
}
K = 4
WINDOW = "measured window"
# `--smoke`: workload sizes for the tests (seconds); flags still override.
SMOKE = {
    "mlp_width": 256,
    "mlp_depth": 2,
    "mlp_input": 128,
    "mlp_batch": 32,
    "transformer_batch": 8,
    "transformer_sequence": 32,
    "transformer_width": 32,
}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument(
        "--workloads", nargs="+", default=["mlp", "transformer"]
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=CONFIGS,
        choices=CONFIGS + list(FEATURE_CONFIGS),
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--mlp-width", type=int, default=2048)
    parser.add_argument("--mlp-depth", type=int, default=5)
    parser.add_argument("--mlp-input", type=int, default=1024)
    parser.add_argument("--mlp-batch", type=int, default=256)
    parser.add_argument("--transformer-batch", type=int, default=32)
    parser.add_argument("--transformer-sequence", type=int, default=128)
    parser.add_argument("--transformer-width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    if parser.parse_args(argv).smoke:
        parser.set_defaults(**SMOKE)
    return parser.parse_args(argv)


# -- The worker (one backend, in its own process) --------------------------


def build_model(workload, args):
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    if workload == "mlp":
        model = keras.Sequential([keras.Input((args.mlp_input,))])
        for _ in range(args.mlp_depth):
            model.add(layers.Dense(args.mlp_width, activation="relu"))
        model.add(layers.Dense(10))
        return model
    sequence, width = args.transformer_sequence, args.transformer_width
    tokens = keras.Input((sequence,), dtype="int32")
    x = layers.Embedding(1000, width)(tokens)
    for _ in range(2):
        attended = layers.MultiHeadAttention(4, width // 4)(x, x)
        x = layers.LayerNormalization()(x + attended)
        hidden = layers.Dense(4 * width, activation="gelu")(x)
        x = layers.LayerNormalization()(x + layers.Dense(width)(hidden))
    outputs = layers.Dense(10)(layers.GlobalAveragePooling1D()(x))
    return keras.Model(tokens, outputs)


def batch_of(workload, args, size):
    import numpy as np

    rng = np.random.default_rng(0)
    if workload == "mlp":
        x = rng.normal(size=(size, args.mlp_input)).astype("float32")
    else:
        shape = (size, args.transformer_sequence)
        x = rng.integers(0, 1000, size=shape).astype("int32")
    return x, rng.integers(0, 10, size=(size,)).astype("int32")


def make_optimizer(config):
    import keras

    from accum_optimizers import AdamAccumulate

    if config == "ours_k4":
        return AdamAccumulate(accum_iters=K)
    if config in FEATURE_CONFIGS:
        return AdamAccumulate(accum_iters=K, **FEATURE_CONFIGS[config])
    if config == "keras_builtin_k4":
        return keras.optimizers.Adam(gradient_accumulation_steps=K)
    if config in ("parent", "parent_4b"):
        return keras.optimizers.Adam()
    raise ValueError(f"Unknown configuration: {config!r}")


def nbytes(variables):
    import numpy as np

    return int(
        sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables)
    )


def compiled_model(workload, config, args, jit_compile):
    import keras

    model = build_model(workload, args)
    model.compile(
        optimizer=make_optimizer(config),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    micro_batch = getattr(args, f"{workload}_batch")
    size = micro_batch * (K if config == "parent_4b" else 1)
    x, y = batch_of(workload, args, size)
    # Builds the layers and the optimizer without running a step (the
    # metrics' variables exist from `compile`).
    model(x[:1])
    model.optimizer.build(model.trainable_variables)
    return model, (x, y)


def jax_peak(model, data):
    """Peak bytes of Keras' train step compiled as `fit` compiles it."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    analysis = step.lower(state, data).compile().memory_analysis()
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def torch_peak(model, data):
    """Peak bytes over a warm window on CUDA: the allocator's peak."""
    import torch

    for _ in range(K):  # warm: one whole window, allocations made lazily
        model.train_on_batch(*data)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(K):
        model.train_on_batch(*data)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def torch_cpu_peak(build):
    """Peak bytes over a warm window on torch's CPU allocator, which keeps
    no statistics: the profiler's allocation and free events, summed in
    time order from before the model exists (the profiler reports no free
    of a block allocated before it started), at their most during the
    window, each step starting from what is alive.

    Args:
        build: called with no argument, returns `(model, data)`.

    Returns:
        `(peak, model)`.
    """
    import gc

    from torch import profiler

    # A previous model freed during the profile would count as a free of
    # a block the profiler saw allocated (in an earlier profile).
    gc.collect()
    activities = [profiler.ProfilerActivity.CPU]
    with profiler.profile(activities=activities, profile_memory=True) as run:
        model, data = build()
        for _ in range(K):  # warm: one whole window, allocations made lazily
            model.train_on_batch(*data)
        # Each step from what is alive: Keras' steps leave reference
        # cycles holding tensors, which Python's collector frees at
        # moments that differ from run to run.
        gc.disable()
        try:
            with profiler.record_function(WINDOW):
                for _ in range(K):
                    gc.collect()
                    model.train_on_batch(*data)
        finally:
            gc.enable()
    return held_at_most(run.profiler.kineto_results.events(), WINDOW), model


def held_at_most(events, span):
    """The most bytes held at once during the event named `span`.

    Args:
        events: the profiler's events (`kineto_results.events()`), those
            named `"[memory]"` being allocations (positive `nbytes`) and
            frees (negative).
        span: the name of the one event that delimits the time measured.
    """
    window = next(event for event in events if event.name() == span)
    changes = sorted(
        (event for event in events if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    held = peak = 0
    for change in changes:
        if change.start_ns() > window.end_ns():
            break
        held += change.nbytes()
        if change.start_ns() >= window.start_ns():
            peak = max(peak, held)
    return peak


def tensorflow_peak(build):
    """The allocator's peak over a warm window, above what it held before
    the model existed, on the first GPU or else the CPU (whose allocator
    keeps statistics too).

    Args:
        build: called with no argument, returns `(model, data)`.

    Returns:
        `(peak, model)`.
    """
    import gc

    import tensorflow as tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    gc.collect()  # an earlier configuration's model
    before = tf.config.experimental.get_memory_info(device)["current"]
    model, data = build()
    for _ in range(K):  # warm: traced, one whole window run
        model.train_on_batch(*data)
    tf.config.experimental.reset_memory_stats(device)
    for _ in range(K):
        model.train_on_batch(*data)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return int(peak - before), model


def tensorflow_xla_peak(model, data):
    """Peak bytes of the train step under `tf.function(jit_compile=True)`.

    TensorFlow gives the step's HLO but no memory analysis of it: the HLO
    (whose resource variables TensorFlow aliases to their updated values)
    is compiled by the XLA in jaxlib, for this host, and measured as for
    JAX. Another build of XLA than TensorFlow's own, on the same program.
    """
    import jax
    import jax.extend
    import tensorflow as tf

    # jaxlib's private converter and compiler entry points (a benchmark's
    # use, not the package's): the only public route from HLO to XLA's
    # memory analysis.
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    @tf.function(jit_compile=True)
    def step(x, y):
        return model.train_step((x, y))

    data = [tf.constant(d) for d in data]
    hlo = step.experimental_get_compiler_ir(*data)(stage="hlo_serialized")
    with mlir.make_ir_context():
        module = str(
            ir.Module.parse(xla_client._xla.mlir.hlo_to_stablehlo(hlo))
        )
    backend = jax.extend.backend.get_backend("cpu")
    devices = xla_client.DeviceList(tuple(jax.devices("cpu")[:1]))
    compiled = backend.compile_and_load(
        module, devices, xla_client.CompileOptions()
    )
    stats = compiled.get_compiled_memory_stats()
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def measure(mode, workload, config, args):
    # torch runs `fit`'s step eagerly by default, as measured here.
    jit_compile = mode in ("jax", "tensorflow-xla")

    def build():
        return compiled_model(workload, config, args, jit_compile)

    if mode == "tensorflow":
        return record(mode, workload, config, *tensorflow_peak(build))
    if mode == "tensorflow-mirrored":
        return mirrored_record(workload, config, build)
    if mode == "torch" and not torch_cuda():
        return record(mode, workload, config, *torch_cpu_peak(build))
    model, data = build()
    peak = {
        "jax": jax_peak,
        "torch": torch_peak,
        "tensorflow-xla": tensorflow_xla_peak,
    }[mode](model, data)
    return record(mode, workload, config, peak, model)


def mirrored_record(workload, config, build):
    """`record` under `MirroredStrategy` over `REPLICAS` CPU devices, whose
    replicas each hold one sum per parameter."""

    def build_in_scope():
        with mirrored_strategy().scope():
            return build()

    peak, model = tensorflow_peak(build_in_scope)
    figures = record("tensorflow-mirrored", workload, config, peak, model)
    figures["sums_bytes"] *= REPLICAS
    return figures


@functools.cache
def mirrored_strategy():
    """One strategy per process: the collectives of a second one fail."""
    import tensorflow as tf

    devices = [f"CPU:{i}" for i in range(REPLICAS)]
    return tf.distribute.MirroredStrategy(devices)


def torch_cuda():
    import torch

    return torch.cuda.is_available()


def record(mode, workload, config, peak, model):
    """One configuration's figures: `peak` and `model`'s sizes."""
    return {
        "mode": mode,
        "workload": workload,
        "config": config,
        "peak_bytes": peak,
        "state_bytes": nbytes(model.optimizer.variables),
        # One float32 sum per trainable parameter.
        "sums_bytes": nbytes(model.trainable_variables),
    }


def worker(args):
    configs = args.configs
    if args.worker == "tensorflow-mirrored":
        # Keras' own accumulation raises under MirroredStrategy in a graph
        # (keras-team/keras#20582).
        configs = [c for c in configs if c != "keras_builtin_k4"]
    if args.worker in ("tensorflow", "tensorflow-mirrored"):
        import tensorflow as tf

        # One op at a time, in the graph's order: with parallel ops the
        # allocator's peak depends on their interleaving, which varies
        # from step to step by more than a small model's sums.
        tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.worker == "tensorflow-mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        replicas = [tf.config.LogicalDeviceConfiguration()] * REPLICAS
        tf.config.set_logical_device_configuration(cpu, replicas)
    for workload in args.workloads:
        for config in configs:
            record = measure(args.worker, workload, config, args)
            print(json.dumps(record), flush=True)


# -- The report --------------------------------------------------------------


# TensorFlow's CPU allocator keeps the statistics read here only with
# oneDNN's options on, which TensorFlow turns on by itself only on CPUs with
# AVX-512 (on others `get_memory_info("CPU:0")` raises).
TENSORFLOW_CPU_STATISTICS = {"TF_ENABLE_ONEDNN_OPTS": "1"}


def run_mode(mode, argv, timeout=None):
    """Runs the worker of `mode` with the options `argv`, killed after
    `timeout` seconds (`subprocess.TimeoutExpired`); returns its records,
    and one error record if it failed."""
    env = dict(
        os.environ,
        KERAS_BACKEND=MODES[mode],
        TF_CPP_MIN_LOG_LEVEL="3",
        **TENSORFLOW_CPU_STATISTICS,
    )
    command = [sys.executable, "-m", "benchmarks.memory", "--worker", mode]
    result = subprocess.run(
        command + argv,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    records = [
        json.loads(line)
        for line in result.stdout.splitlines()
        if line.startswith("{")
    ]
    if result.returncode:
        records.append({"mode": mode, "error": result.stderr[-2000:]})
    return records


def medians(runs):
    """One record per configuration, its peak the median over `runs` (lists
    of one worker's records); an error of any run is kept."""
    import statistics

    errors = [r for records in runs for r in records if "error" in r]
    first = [r for r in runs[0] if "error" not in r]
    for record in first:
        peaks = [
            r["peak_bytes"]
            for records in runs
            for r in records
            if r.get("workload") == record["workload"]
            and r.get("config") == record["config"]
        ]
        record["peak_bytes"] = int(statistics.median(peaks))
        record["peaks_bytes"] = peaks
    return first + errors


def mib(count):
    return "n/a" if count is None else f"{count / 2**20:.1f}"


def table(records):
    """Markdown: per mode and workload, each configuration's peak (or
    state) and `extra / sums` against the parent at `b`."""
    measured = {r.get("config") for r in records}
    columns = [c for c in COLUMNS if c in CONFIGS or c in measured]
    lines = [
        "| mode | workload | measured | sums MiB | parent b MiB | "
        + " | ".join(f"{COLUMNS[c]} extra/sums" for c in columns)
        + " |",
        "|---" * (5 + len(columns)) + "|",
    ]
    groups = {}
    for record in records:
        if "error" in record:
            lines.append(
                f"| {record['mode']} | error |" + " |" * (3 + len(columns))
            )
            continue
        groups.setdefault((record["mode"], record["workload"]), {})[
            record["config"]
        ] = record
    for (mode, workload), configs in groups.items():
        peaks = all(r["peak_bytes"] is not None for r in configs.values())
        key = "peak_bytes" if peaks else "state_bytes"
        sums = configs["parent"]["sums_bytes"]
        base = configs["parent"][key]
        ratios = {
            config: f"{(configs[config][key] - base) / sums:.2f}"
            if config in configs
            else "n/a"
            for config in columns
        }
        if not peaks:  # a larger batch holds no more state
            ratios["parent_4b"] = "n/a"
        lines.append(
            f"| {mode} | {workload} | {'peak' if peaks else 'state only'} "
            f"| {mib(sums)} | {mib(base)} | "
            + " | ".join(ratios[c] for c in columns)
            + " |"
        )
    return "\n".join(lines)


def worker_arguments(args):
    """The command line of a worker: every option but `--modes`, `--out`."""
    passed = ["--workloads", *args.workloads, "--configs", *args.configs]
    for name in (
        "mlp_width",
        "mlp_depth",
        "mlp_input",
        "mlp_batch",
        "transformer_batch",
        "transformer_sequence",
        "transformer_width",
    ):
        passed += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return passed


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        return worker(args)
    passed = worker_arguments(args)
    records = []
    for mode in args.modes:
        repeats = args.repeats if mode in ALLOCATOR_MODES else 1
        records += medians([run_mode(mode, passed) for _ in range(repeats)])
    markdown = table(records)
    print(markdown)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory.json").write_text(json.dumps(records, indent=1))
        (args.out / "memory.md").write_text(markdown + "\n")
    failed = [r for r in records if "error" in r]
    for record in failed:
        print(f"{record['mode']} failed:\n{record['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
