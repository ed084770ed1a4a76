"""TensorFlow under XLA: what a compiled step costs per variable it may
write, on every call, whether it writes it or not.

    KERAS_BACKEND=tensorflow python -m benchmarks.xla_outputs
        [--workload transformer] [--copies 1 2 3] [--calls 200]

Compiles a fixed computation (a 512x512 matmul) with `jit_compile=True`,
alone and beside writes of variables: the workload's trainable variables'
shapes, `--copies` times over (the window's close under XLA carries the
weights and each of Adam's two moments: three copies), carried by the
close's own zero-or-once loop (`_backend.tensorflow._once_if`) where it
does not run, and written on every call with the value they hold; and,
for each, as many floats in two variables carried by the loop. The
configurations alternate call by call; prints the median microseconds per
call of each, and the cost per variable.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--calls", type=int, default=200)
    return parser.parse_args(argv)


def steps(shapes, copies):
    """`{name: (compiled step, variables written)}`: the computation alone,
    and beside the close's loop (`_once_if`, not run) carrying `copies`
    variables of each of `shapes`, beside writes of as many on every call,
    or beside the loop carrying as many floats in two variables (written:
    `None`)."""
    import keras
    import tensorflow as tf

    from accum_optimizers._backend.tensorflow import _once_if

    def zeros(shape):
        # Keras variables, as the window's sums are.
        return keras.Variable(np.zeros(shape, "float32"))

    matrix = tf.Variable(tf.ones([512, 512]))
    runs = tf.Variable(0)

    def compiled(write):
        @tf.function(jit_compile=True)
        def step(x):
            result = tf.reduce_sum(tf.matmul(matrix, matrix) * x)
            write()
            return result

        return step

    def in_loop(variables):
        return lambda: _once_if(runs > 0, lambda: None, variables)

    def every_call(variables):
        return lambda: [v.assign(v.value) for v in variables]

    floats = sum(int(np.prod(shape)) for shape in shapes)
    result = {"computation alone": (compiled(lambda: None), None)}
    for n in copies:
        many = [zeros(s) for s in shapes for _ in range(n)]
        written = [zeros(s) for s in shapes for _ in range(n)]
        flat = [zeros([floats * n // 2]) for _ in range(2)]
        result[f"loop over {len(many)} variables"] = (
            compiled(in_loop(many)),
            len(many),
        )
        result[f"{len(written)} variables written, every call"] = (
            compiled(every_call(written)),
            len(written),
        )
        result[f"loop over their floats in 2 variables (x{n})"] = (
            compiled(in_loop(flat)),
            None,
        )
    return result


def profile(configurations, calls):
    """Median microseconds per call of each, alternating call by call."""
    import tensorflow as tf

    x = tf.constant(1.0)
    for step, _ in configurations.values():
        for _ in range(5):
            step(x).numpy()
    times = {name: [] for name in configurations}
    for _ in range(calls):
        for name, (step, _) in configurations.items():
            start = time.perf_counter()
            step(x).numpy()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    args = parse(argv)
    from benchmarks import workloads

    model = workloads.build(args.workload)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    configurations = steps(shapes, args.copies)
    medians = profile(configurations, args.calls)
    alone = medians["computation alone"]
    print(f"{'configuration':48s} {'us/call':>9s} {'us/variable':>12s}")
    for name, us in medians.items():
        carried = configurations[name][1]
        per = f"{(us - alone) / carried:12.1f}" if carried else ""
        print(f"{name:48s} {us:9.0f} {per}")


if __name__ == "__main__":
    main()
