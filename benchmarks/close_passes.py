"""TensorFlow without XLA: the memory traffic of the window's compiled close
against its floor.

    KERAS_BACKEND=tensorflow python -m benchmarks.close_passes
        [--workload mlp] [--calls 300]

Builds Adam with `accum_iters=4` on the workload, takes the close that
TensorFlow's XLA compiles (`_backend.tensorflow_xla`), and reads its
optimized HLO: each top-level computation (a fused loop, a reduction)
reads its operands and writes its result, so the parameter-sized arrays
they read and write are the close's traffic. Its floor reads each of the
close's parameter-sized inputs once (the sums, the weights, Adam's
moments) and writes each output once. Then times the close alone (median
of `--calls` calls) and prints both, with the time the floor would take
at the measured rate. Arrays under `LARGE` floats are left out: the
traffic is the large ones'.
"""

import argparse
import math
import os
import re
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Arrays of at least this many floats count as traffic.
LARGE = 2**14
_DEFINITION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) (\S+?)\((.*)$")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
# Instructions that read or write no array of their own.
_NOT_MOVING = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, not {args.calls}")
    return args


def compiled_close(workload):
    """The XLA-compiled close of Adam k=4 on `workload`, built by `fit`."""
    from accum_optimizers._backend import tensorflow_xla
    from benchmarks import window_steps

    compiled = []
    original = tensorflow_xla._compiled

    def keeping(close, window):
        compiled.append(original(close, window))
        return compiled[-1]

    tensorflow_xla._compiled = keeping
    try:
        window_steps.compiled_step(workload, "ours_k4", "adam")
    finally:
        tensorflow_xla._compiled = original
    if not compiled:
        raise SystemExit(f"{workload}: the close is not compiled (too small)")
    return compiled[-1]


def _floats(shape):
    """Floats in each array of an HLO shape (a tuple's elements apart)."""
    return [
        math.prod(int(d) for d in dims.split(",") if d)
        for dims in _SHAPE.findall(shape)
    ]


def traffic(hlo):
    """`(floats moved, floor)`: the large arrays the entry computation's
    instructions read and write, and those its inputs and outputs hold."""
    entry = hlo[hlo.index("\nENTRY") :].splitlines()[1:]
    shapes, moved, floor = {}, 0, 0
    for line in entry:
        found = _DEFINITION.match(line)
        if not found:
            continue
        name, shape, opcode, rest = found.groups()
        shapes[name] = shape
        large = _large(shape)
        if opcode == "parameter" or line.lstrip().startswith("ROOT"):
            floor += large
        if opcode in _NOT_MOVING:
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
        moved += large + sum(_large(shapes.get(o, "")) for o in operands)
    return moved, floor


def _large(shape):
    """The floats in the arrays of `shape` that count as traffic."""
    return sum(f for f in _floats(shape) if f >= LARGE)


def seconds_per_call(close, calls):
    """The median seconds of `calls` calls of `close`, after a warm-up."""
    for _ in range(10):
        close()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        close()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    import keras

    args = parse(argv)
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("close_passes needs KERAS_BACKEND=tensorflow")
    close = compiled_close(args.workload)
    hlo = close.experimental_get_compiler_ir()(stage="optimized_hlo")
    moved, floor = traffic(hlo)
    ms = seconds_per_call(close, args.calls) * 1e3
    mib_per_float = 4 / 2**20
    print(f"{args.workload}, Adam k=4: the close compiled by XLA, alone")
    print(
        f"moved: {moved * mib_per_float:.1f} MiB, the floor: "
        f"{floor * mib_per_float:.1f} MiB ({moved / floor:.2f}x)"
    )
    print(
        f"close: {ms:.3f} ms; at that rate the floor: "
        f"{ms * floor / moved:.3f} ms"
    )


if __name__ == "__main__":
    main()
