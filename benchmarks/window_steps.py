"""What each micro-step of a window costs, on JAX: a profile by position.

    KERAS_BACKEND=jax python -m benchmarks.window_steps [--workload mlp]
                                                     [--windows 100]

Jits Keras' own `train_step` with the state donated (as `model.fit` does),
then times it call by call, by position in a window of 4, for the parent
optimizer, ours (`accum_iters=4`), the add-only ceiling and Keras' built-in
`gradient_accumulation_steps=4`, with Adam, SGD with momentum and RMSprop.
Prints ms per call (median over `--windows`, default 100), the mean over
the window, and the number of `copy` instructions in the compiled step.
Ours should cost the ceiling on steps 1-3 and the parent on step 4.
"""

import argparse
import contextlib
import os
import re
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

from benchmarks import worker  # noqa: E402
from benchmarks import workloads  # noqa: E402

CONFIGS = ("parent", "ours_k4", "ceiling", "keras_builtin_k4")


def profile(workload, config, optimizer_name, windows):
    """Returns (ms per position in the window, copies in the step)."""
    batch = workloads.WORKLOADS[workload][0]
    x, y = workloads.data(workload, batch * 8)
    model, _ = worker.compiled_model(
        workload, config, optimizer_name, True, contextlib.nullcontext
    )
    model.fit(x, y, batch_size=batch, verbose=0)  # builds every variable
    step = jax.jit(model.train_step, donate_argnums=0)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    data = (x[:batch], y[:batch])
    compiled = step.lower(state, data).compile().as_text()
    copies = len(re.findall(r"= \S+ copy\(", compiled))
    times = [[] for _ in range(worker.K)]
    for _ in range(windows):
        for position in range(worker.K):
            start = time.perf_counter()
            _, state = step(state, data)
            jax.block_until_ready(state)
            times[position].append((time.perf_counter() - start) * 1e3)
    # The first tenth is warm-up.
    return [statistics.median(t[len(t) // 10 :]) for t in times], copies


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", default="mlp", choices=workloads.WORKLOADS
    )
    parser.add_argument("--windows", type=int, default=100)
    args = parser.parse_args(argv)
    if os.environ["KERAS_BACKEND"] != "jax":
        parser.error(
            f"needs KERAS_BACKEND=jax, not {os.environ['KERAS_BACKEND']}"
        )
    print(f"{args.workload}, jax.jit; ms per call by position in the window")
    print("| optimizer | configuration | 1 | 2 | 3 | 4 | mean | copies |")
    print("|---|---|---|---|---|---|---|---|")
    for optimizer_name in worker.OPTIMIZERS:
        for config in CONFIGS:
            ms, copies = profile(
                args.workload, config, optimizer_name, args.windows
            )
            cells = " | ".join(f"{m:.2f}" for m in ms)
            mean = sum(ms) / len(ms)
            print(
                f"| {optimizer_name} | {config} | {cells} | {mean:.2f} "
                f"| {copies} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
