"""Why the TensorFlow gate is a while loop: XLA cost of each way to gate.

    python -m benchmarks.xla_gate [--jit | --no-jit]

Times one `tf.function` step on four 1.3 M-float variables (a weight, Adam's
two moments, an accumulator, the MLP's size): the step adds a gradient into
the accumulator and, gated, runs an Adam-like update of the other three.
Each gate is timed with the update not taken and taken:

- `add_only`: no update at all (the floor);
- `cond`: the update in a `tf.cond` branch;
- `while`: the update in the shipped gate, a `tf.while_loop` that runs zero
  times or once (`_backend.tensorflow._run_at_most_once`);
- `always`: the update every step (no gate).

Under XLA the `cond` step costs about 3x `add_only` even when not taken
(XLA copies every variable the conditional writes), while the `while` step
costs what `add_only` does; the `tf.function` without XLA shows no such gap.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

from accum_optimizers._backend.tensorflow import _run_at_most_once  # noqa: E402

SIZE = 1_300_000
GATES = ("add_only", "cond", "while", "always")


def make_step(gate, jit_compile):
    weight, m, v, accumulator = (
        tf.Variable(tf.random.normal([SIZE])) for _ in range(4)
    )

    def update():
        grad = accumulator / 4.0
        m.assign(0.9 * m + 0.1 * grad)
        v.assign(0.999 * v + 0.001 * grad * grad)
        weight.assign_sub(0.001 * m / (tf.sqrt(v) + 1e-7))
        accumulator.assign(tf.zeros_like(accumulator))

    @tf.function(jit_compile=jit_compile)
    def step(grad, taken):
        accumulator.assign_add(grad)
        if gate == "cond":

            def branch():
                update()
                return tf.constant(True)

            tf.cond(taken, branch, lambda: tf.constant(False))
        elif gate == "while":
            _run_at_most_once(taken, update)  # the shipped gate
        elif gate == "always":
            update()

    return step


def milliseconds(step, taken, calls=300, rounds=5):
    grad = tf.random.normal([SIZE])
    flag = tf.constant(taken)
    for _ in range(20):
        step(grad, flag)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step(grad, flag)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--jit", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    print(
        f"jit_compile={args.jit}; ms per step "
        f"(median of 5 x {args.calls} calls)"
    )
    print("| gate | not taken | taken |")
    print("|---|---|---|")
    for gate in GATES:
        step = make_step(gate, args.jit)
        skipped = milliseconds(step, False, args.calls)
        taken = milliseconds(step, True, args.calls)
        print(f"| {gate} | {skipped:.2f} | {taken:.2f} |", flush=True)


if __name__ == "__main__":
    main()
