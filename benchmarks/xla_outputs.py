"""TensorFlow under XLA: what a compiled step costs per variable it may
write, on every call, whether it writes it or not.

    KERAS_BACKEND=tensorflow python -m benchmarks.xla_outputs
        [--workload transformer] [--copies 1 2 3] [--calls 200]

Compiles a fixed computation (a 512x512 matmul) with `jit_compile=True`,
alone and beside writes of variables: the workload's trainable variables'
shapes, `--copies` times over (the window's close under XLA carries the
weights and each of Adam's two moments: three copies), in a
`tf.while_loop` of zero trips whose body would write them, and written on
every call with the value they hold; and, for each, the same number of
floats in two flat variables in the loop. The configurations alternate
call by call; prints the median microseconds per call of each, and the
cost per variable.
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


def loop_writing(variables, runs):
    """A loop of `runs` trips (0 here) whose body writes `variables`."""
    import tensorflow as tf
    from tensorflow.compiler.tf2xla.python import xla

    def body(trips):
        # The barrier keeps XLA from hoisting the body's reads out of the
        # loop, as the close's does.
        trips, *values = xla.optimization_barrier(
            trips, *[v.read_value() for v in variables]
        )
        for variable, value in zip(variables, values):
            variable.assign(value * 0.5)
        return (trips + 1,)

    tf.while_loop(
        lambda trips: trips < runs,
        body,
        (tf.constant(0),),
        maximum_iterations=1,
    )


def steps(shapes, copies):
    """`{name: (compiled step, variables written)}`: the computation alone,
    and beside a loop carrying `copies` variables of each of `shapes`,
    beside writes of as many on every call, or beside a loop carrying as
    many floats in two variables (written: `None`)."""
    import tensorflow as tf

    matrix = tf.Variable(tf.ones([512, 512]))
    runs = tf.Variable(0)

    def compute(x):
        return tf.reduce_sum(tf.matmul(matrix, matrix) * x)

    def compiled(variables, in_loop=True):
        @tf.function(jit_compile=True)
        def step(x):
            result = compute(x)
            if variables and in_loop:
                loop_writing(variables, runs)
            for variable in [] if in_loop else variables:
                variable.assign(variable.read_value())
            return result

        return step

    floats = sum(int(np.prod(shape)) for shape in shapes)
    result = {"computation alone": (compiled([]), None)}
    for n in copies:
        many = [tf.Variable(tf.zeros(s)) for s in shapes for _ in range(n)]
        flat = [tf.Variable(tf.zeros([floats * n // 2])) for _ in range(2)]
        result[f"loop over {len(many)} variables"] = (compiled(many), len(many))
        written = [tf.Variable(tf.zeros(s)) for s in shapes for _ in range(n)]
        result[f"{len(many)} variables written, every call"] = (
            compiled(written, in_loop=False),
            len(written),
        )
        result[f"loop over their floats in 2 variables (x{n})"] = (
            compiled(flat),
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
