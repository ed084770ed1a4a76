"""What each micro-step of a window costs: a profile by position.

    KERAS_BACKEND=jax python -m benchmarks.window_steps [--workload mlp]
                                                     [--windows 100]
    KERAS_BACKEND=tensorflow python -m benchmarks.window_steps [--xla]
    KERAS_BACKEND=torch python -m benchmarks.window_steps [--skip-nonfinite]
                                                     [--noise-scale]
                                                     [--micro-batch 128]
    KERAS_BACKEND=tensorflow python -m benchmarks.window_steps --compiled-close
                                                     [--sizes 50000 140000]

Compiles Keras' own `train_step` the way `model.fit` does on the backend
(`jax.jit` with the state donated; `tf.function`, with `jit_compile` under
`--xla`; torch runs it eagerly), then times it call by call, by position in
a window of 4, for the parent optimizer, ours (`accum_iters=4`), the
add-only ceiling and Keras' built-in `gradient_accumulation_steps=4`, with
Adam, SGD with momentum and RMSprop; in a TensorFlow graph (without
`--xla`) also Keras' built-in made to wait for the whole backward pass
before it writes, as ours does (`keras_builtin_k4_after_backward`, see
`benchmarks/after_backward.py`). The four configurations of an
optimizer are built side by side in one process, warmed up for one window
each, then timed alternately, in 10 rounds of `--windows / 10` windows
each, so that a drift of the process's speed falls on all of them. Prints
ms per call (median over `--windows`, default 100), the mean over the
window and, on JAX, the number of `copy` instructions in the compiled
step. Ours should cost the ceiling on steps 1-3 and the parent on step 4.
`--skip-nonfinite` times the parent, ours and ours with
`skip_nonfinite=True` (`ours_k4_skip`), the last two on one model and
optimizer, for the cost of the check. `--noise-scale` times the parent,
ours and ours with `measure_noise_scale=True` (`ours_k4_noise`), and with
`--skip-nonfinite` too both together (`ours_k4_skip_noise`, one pass of
squares for the check and the measurement), on one model built with the
measurement. `--micro-batch` sets the samples per micro-batch (default:
the workload's).

`--compiled-close` (TensorFlow without XLA) times ours with
`jit_compile=True` and `False` side by side on MLPs of `--sizes`
parameters (input, two hidden layers of one width, 10 outputs) and prints
the window's close with each and their ratio, the size rule of
`jit_compile="auto"` (`accum_optimizers._backend.tensorflow_xla`).
"""

import argparse
import contextlib
import os
import re
import statistics
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import worker  # noqa: E402
from benchmarks import workloads  # noqa: E402

CONFIGS = ("parent", "ours_k4", "ceiling", "keras_builtin_k4")
# Only in a TensorFlow graph do Keras' built-in's writes overlap the
# backward pass.
GRAPH_CONFIGS = ("keras_builtin_k4_after_backward",)


def _jax_step(model, data):
    """Returns (one synchronous step, copies in the compiled step)."""
    import jax

    # A function of its own: JAX caches traces by function, and a second
    # step of the same model may trace it differently (`skip_nonfinite`).
    step = jax.jit(
        lambda state, data: model.train_step(state, data), donate_argnums=0
    )
    # Copies: a second step of the same model must not find its state
    # donated by the first.
    state = [
        [jax.numpy.copy(v.value) for v in model.trainable_variables],
        [jax.numpy.copy(v.value) for v in model.non_trainable_variables],
        [jax.numpy.copy(v.value) for v in model.optimizer.variables],
        [jax.numpy.copy(v.value) for v in model.metrics_variables],
    ]
    compiled = step.lower(state, data).compile().as_text()

    def run():
        _, state[:] = step(state, data)
        jax.block_until_ready(state)

    return run, len(re.findall(r"= \S+ copy\(", compiled))


def _tensorflow_step(model, data, xla):
    import tensorflow as tf

    step = tf.function(model.train_step, jit_compile=xla)
    return lambda: step(data), None


def _torch_step(model, data):
    return lambda: model.train_step(data), None


def compiled_step(
    workload, config, optimizer_name, xla=False, micro_batch=None
):
    """Returns (one synchronous train step of `config`, copies in it), on
    micro-batches of `micro_batch` samples (`None`: the workload's)."""
    batch = micro_batch or workloads.WORKLOADS[workload][0]
    x, y = workloads.data(workload, batch * 8)
    model, _ = worker.compiled_model(
        workload, config, optimizer_name, xla, contextlib.nullcontext
    )
    model.fit(x, y, batch_size=batch, verbose=0)  # builds every variable
    return step_runner(model, (x[:batch], y[:batch]), xla)


def skip_toggled_steps(
    workload, optimizer_name, xla=False, micro_batch=None, noise_scale=False
):
    """Returns `{config: (step, copies)}` for `ours_k4` and `ours_k4_skip`
    on one model and optimizer, `skip_nonfinite` set before each call (read
    when the step is traced, or at each call eagerly): the two differ by
    the check alone, not by where their buffers lie (two builds of one
    configuration differ by more than the check costs). `micro_batch` as
    in `compiled_step`. With `noise_scale`, the model's optimizer is built
    with `measure_noise_scale=True` and the measurement is toggled the
    same way (`ours_k4_noise`, and with `skip` too, `ours_k4_skip_noise`),
    its variables present in every configuration."""
    batch = micro_batch or workloads.WORKLOADS[workload][0]
    x, y = workloads.data(workload, batch * 8)
    built_as = "ours_k4_noise" if noise_scale else "ours_k4"
    model, _ = worker.compiled_model(
        workload, built_as, optimizer_name, xla, contextlib.nullcontext
    )
    model.fit(x, y, batch_size=batch, verbose=0)
    optimizer = model.optimizer
    settings = [("ours_k4", False, False), ("ours_k4_skip", True, False)]
    if noise_scale:
        settings += [
            ("ours_k4_noise", False, True),
            ("ours_k4_skip_noise", True, True),
        ]
    steps = {}
    for config, skip, measure in settings:
        _set(optimizer, skip, measure)
        run, copies = step_runner(model, (x[:batch], y[:batch]), xla)
        steps[config] = (_with_settings(optimizer, skip, measure, run), copies)
    return steps


def _set(optimizer, skip, measure):
    with warnings.catch_warnings():
        # (Each setting runs its own traced step: the warning that a
        # compiled train function keeps the old value is not for it.)
        warnings.simplefilter("ignore")
        optimizer.skip_nonfinite = skip
        optimizer.measure_noise_scale = measure


def _with_settings(optimizer, skip, measure, run):
    def run_with_settings():
        _set(optimizer, skip, measure)
        run()

    return run_with_settings


def step_runner(model, data, xla=False):
    """Returns (one synchronous call of the built `model`'s `train_step` on
    `data`, compiled as `fit` compiles it; copies in it, or `None`)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_step(model, data)
    if backend == "tensorflow":
        return _tensorflow_step(model, data, xla)
    return _torch_step(model, data)


def profile(steps, windows, rounds=10):
    """Times each step by position in a window, the steps alternating.

    Args:
        steps: a dict from configuration to a function that runs one
            synchronous train step.
        windows: windows of `worker.K` calls timed per configuration.
        rounds: how many times the configurations take turns.

    Returns a dict from configuration to its median ms per position.
    """
    rounds = max(1, min(rounds, windows))
    times = {config: [[] for _ in range(worker.K)] for config in steps}
    for run in steps.values():  # warm-up: tracing, both branches
        for _ in range(worker.K):
            run()
    for _round in range(rounds):
        for config, run in steps.items():
            for _ in range(windows // rounds):
                for position in range(worker.K):
                    start = time.perf_counter()
                    run()
                    elapsed = time.perf_counter() - start
                    times[config][position].append(elapsed * 1e3)
    return {
        config: [statistics.median(t) for t in by_position]
        for config, by_position in times.items()
    }


def mlp_of(parameters, seed=0):
    """An MLP `w/2 -> w -> w -> 10` of about `parameters` parameters."""
    # 1.5 w^2 + 12 w + 10 parameters.
    width = max(2, round(((144 + 6 * (parameters - 10)) ** 0.5 - 12) / 3))
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((width // 2,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in "ab"]
    return keras.Sequential(layers + [keras.layers.Dense(10)])


def compiled_close_rows(sizes, windows, micro_batch=32):
    """`[(parameters, ms compiled, ms TensorFlow's ops)]`: the closing call
    of `AdamAccumulate(accum_iters=4, jit_compile=...)`, both alternating
    in one process, for an MLP of about each of `sizes` parameters."""
    from accum_optimizers import AdamAccumulate

    rows = []
    for size in sizes:
        steps = {}
        for jit_compile in (True, False):
            model = mlp_of(size)
            model.compile(
                AdamAccumulate(accum_iters=worker.K, jit_compile=jit_compile),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=False,
            )
            rng = np.random.default_rng(0)
            samples = micro_batch * 2 * worker.K  # two windows: aligned
            x = rng.normal(size=(samples, model.input_shape[1]))
            x = x.astype("float32")
            y = rng.integers(0, 10, size=(samples,)).astype("int32")
            model.fit(x, y, batch_size=micro_batch, verbose=0)
            steps[jit_compile], _ = step_runner(
                model, (x[:micro_batch], y[:micro_batch])
            )
        ms = profile(steps, windows)
        rows.append((model.count_params(), ms[True][-1], ms[False][-1]))
    return rows


def _print_compiled_close(sizes, windows):
    print("TensorFlow graph, Adam k=4: ms of the call that closes the window")
    print("| parameters | compiled | TensorFlow's ops | compiled / ops |")
    print("|---|---|---|---|")
    for parameters, compiled, plain in compiled_close_rows(sizes, windows):
        print(
            f"| {parameters} | {compiled:.2f} | {plain:.2f} "
            f"| {compiled / plain:.2f} |",
            flush=True,
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", default="mlp", choices=workloads.WORKLOADS
    )
    parser.add_argument("--windows", type=int, default=100)
    parser.add_argument(
        "--optimizers", nargs="+", default=list(worker.OPTIMIZERS)
    )
    parser.add_argument("--xla", action="store_true")
    parser.add_argument("--skip-nonfinite", action="store_true")
    parser.add_argument("--noise-scale", action="store_true")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="samples per micro-batch (default: the workload's)",
    )
    parser.add_argument("--compiled-close", action="store_true")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[25_000, 50_000, 100_000, 140_000, 200_000, 400_000],
        help="parameters of the MLPs of --compiled-close",
    )
    args = parser.parse_args(argv)
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error(f"--micro-batch must be >= 1, not {args.micro_batch}")
    backend = keras.backend.backend()
    if args.xla and backend != "tensorflow":
        parser.error(f"--xla needs KERAS_BACKEND=tensorflow, not {backend}")
    if args.compiled_close:
        if backend != "tensorflow" or args.xla:
            parser.error(
                "--compiled-close needs KERAS_BACKEND=tensorflow without "
                f"--xla; got {backend}" + (" with --xla" if args.xla else "")
            )
        return _print_compiled_close(args.sizes, args.windows)
    how = {
        "jax": "jax.jit",
        "tensorflow": "tf.function" + (", XLA" if args.xla else ""),
        "torch": "eager",
    }[backend]
    batch = args.micro_batch or workloads.WORKLOADS[args.workload][0]
    print(
        f"{args.workload}, micro-batch {batch}, {how}; "
        "ms per call by position in the window"
    )
    print("| optimizer | configuration | 1 | 2 | 3 | 4 | mean | copies |")
    print("|---|---|---|---|---|---|---|---|")
    for optimizer_name in args.optimizers:
        steps, copies = {}, {}
        toggled = args.skip_nonfinite or args.noise_scale
        configs = ("parent",) if toggled else CONFIGS
        if backend == "tensorflow" and not args.xla and not toggled:
            configs += GRAPH_CONFIGS
        for config in configs:
            steps[config], copies[config] = compiled_step(
                args.workload, config, optimizer_name, args.xla, batch
            )
        if toggled:
            toggled_steps = skip_toggled_steps(
                args.workload, optimizer_name, args.xla, batch, args.noise_scale
            )
            if not args.skip_nonfinite:
                for config in ("ours_k4_skip", "ours_k4_skip_noise"):
                    toggled_steps.pop(config, None)
            for config, (step, copied) in toggled_steps.items():
                steps[config], copies[config] = step, copied
        for config, ms in profile(steps, args.windows).items():
            cells = " | ".join(f"{m:.2f}" for m in ms)
            mean = sum(ms) / len(ms)
            print(
                f"| {optimizer_name} | {config} | {cells} | {mean:.2f} "
                f"| {'-' if copies[config] is None else copies[config]} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
