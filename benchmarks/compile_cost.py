"""TensorFlow without XLA: what compiling the window's close costs a first
`fit` and saves the later ones, on a GPT2-shaped model.

    KERAS_BACKEND=tensorflow python -m benchmarks.compile_cost
        [--rounds 2] [--micro-batches 16] [--windows 40] [--layers 12]
        [--width 256]
    KERAS_BACKEND=tensorflow python -m benchmarks.compile_cost --smoke

Builds keras_hub's `GPT2CausalLM` from a backbone config (no download,
no preprocessor; by default 12 layers of width 256: 196 variables, 10 M
parameters) and, in each of `--rounds` rounds, each configuration in turn
(the order rotated from round to round, a fresh model each): the parent
`Adam` at the micro-batch, and `AdamAccumulate(accum_iters=4)` with
`jit_compile=False` and `True`. Times its first `fit` (the train step
traced, the close compiled where it is) and a second one, each of
`--micro-batches` micro-batches; then the call that closes a window
alone, compiled and not, the two alternating over `--windows` windows (a
later fit's few windows vary more between rounds than the close saves).
`jit_compile="auto"` is one of the two on a given model
(`accum_optimizers._backend.tensorflow_xla.auto_compiles` says which): its
row is that one's, not timed again. Prints the median over the rounds of
each, against `jit_compile=False`: the first fit's extra seconds, what
each window saves, and after how many windows compiling has paid back.
`--smoke`: a one-layer model of width 8, one round of 4 micro-batches
(the tests).
"""

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

K = 4
CONFIGS = ("parent", "False", "True")
SMOKE = dict(
    rounds=1, micro_batches=4, layers=1, width=8, sequence=6, windows=1
)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--vocabulary", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    for name in ("rounds", "micro_batches", "micro_batch", "layers", "windows"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            parser.error(f"--{flag} must be >= 1, not {getattr(args, name)}")
    if args.micro_batches % K:
        parser.error(f"--micro-batches must be a multiple of {K}")
    if args.width < 4 or args.width % 4:
        parser.error(f"--width must be a multiple of 4, not {args.width}")
    return args


def build(args, seed=0):
    """The GPT2-shaped causal LM of `args`' shape, weights fixed by `seed`."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocabulary,
        num_layers=args.layers,
        num_heads=4,
        hidden_dim=args.width,
        intermediate_dim=4 * args.width,
        dropout=0.0,
        max_sequence_length=args.sequence,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def data(args):
    import numpy as np

    n = args.micro_batches * args.micro_batch
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocabulary, (n, args.sequence + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((n, args.sequence), "int32"),
    }
    return x, tokens[:, 1:].astype("int32")


def optimizer(config):
    import keras

    from accum_optimizers import AdamAccumulate

    if config == "parent":
        return keras.optimizers.Adam(1e-4)
    return AdamAccumulate(1e-4, accum_iters=K, jit_compile=config == "True")


def fit_times(args, config, x, y):
    """Seconds of a fresh model's first `fit` and of its second one."""
    import keras

    model = build(args)
    model.compile(
        optimizer(config),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.micro_batch, shuffle=False, verbose=0)
        seconds.append(time.perf_counter() - start)
    return seconds


def close_ms(args, x, y):
    """`{config: ms}` of the call that closes a window, `jit_compile`
    `False` and `True` alternating (`benchmarks.window_steps.profile`)."""
    import keras

    from benchmarks.window_steps import profile
    from benchmarks.window_steps import step_runner

    steps = {}
    for config in ("False", "True"):
        model = build(args)
        model.compile(
            optimizer(config),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        model.fit(x, y, batch_size=args.micro_batch, verbose=0)
        micro_batch = (
            {name: value[: args.micro_batch] for name, value in x.items()},
            y[: args.micro_batch],
        )
        steps[config], _ = step_runner(model, micro_batch)
    ms = profile(steps, args.windows)
    return {config: by_position[-1] for config, by_position in ms.items()}


def measure(args, x, y):
    """`{config: ([first fits], [later fits])}`, the rounds alternating."""
    times = {config: ([], []) for config in CONFIGS}
    for round_ in range(args.rounds):
        shift = round_ % len(CONFIGS)
        for config in CONFIGS[shift:] + CONFIGS[:shift]:
            first, later = fit_times(args, config, x, y)
            times[config][0].append(first)
            times[config][1].append(later)
            print(
                f"round {round_ + 1}, {config}: first fit {first:.2f} s, "
                f"later fit {later:.2f} s",
                flush=True,
            )
    return times


def main(argv=None):
    import keras

    from accum_optimizers._backend.tensorflow_xla import auto_compiles

    args = parse(argv)
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("compile_cost needs KERAS_BACKEND=tensorflow")
    model = build(args)
    shapes = [v.shape for v in model.trainable_variables]
    parameters = sum(math.prod(shape) for shape in shapes)
    compiles = auto_compiles(shapes)
    print(
        f"GPT2CausalLM, {args.layers} layers of width {args.width}: "
        f"{len(shapes)} variables, {parameters:,} parameters; "
        f'jit_compile="auto" compiles its close: {compiles}'
    )
    x, y = data(args)
    times = measure(args, x, y)
    first = {c: statistics.median(t[0]) for c, t in times.items()}
    later = {c: statistics.median(t[1]) for c, t in times.items()}
    print(
        f"\nAdam, k={K}, {args.micro_batches} micro-batches of "
        f"{args.micro_batch} per fit, TF graph: median of {args.rounds} "
        "round(s), seconds"
    )
    print(
        "| configuration | first fit | later fit | first / False "
        "| later / False |"
    )
    print("|---|---|---|---|---|")
    rows = [("parent Adam", "parent"), ("jit_compile=False", "False")]
    rows += [("jit_compile=True", "True")]
    rows += [(f'jit_compile="auto" (= {compiles})', str(compiles))]
    for name, config in rows:
        print(
            f"| {name} | {first[config]:.2f} | {later[config]:.2f} "
            f"| {first[config] / first['False']:.2f} "
            f"| {later[config] / later['False']:.2f} |"
        )
    extra = first["True"] - first["False"]
    closes = close_ms(args, x, y)
    saved = (closes["False"] - closes["True"]) / 1e3
    print(
        f"the closing call, median of {args.windows} windows: "
        f"{closes['True']:.1f} ms compiled, {closes['False']:.1f} ms "
        "TensorFlow's ops"
    )
    print(
        f"compiling: {extra:+.2f} s on the first fit "
        f"({extra / len(shapes) * 1e3:+.1f} ms per variable), "
        f"{saved * 1e3:+.2f} ms saved per window "
        f"({saved / parameters * 1e9:+.2f} ns per parameter)"
    )
    if extra > 0 and saved > 0:
        print(f"pays back after {extra / saved:.0f} windows")
    else:
        print("no payback to compute: a difference is not positive")


if __name__ == "__main__":
    main()
