"""What one optimizer call launches, ours against Keras' built-in
accumulation, on the benchmark MLP (Adam, a window of 4).

    KERAS_BACKEND=tensorflow python -m benchmarks.launches
    KERAS_BACKEND=torch python -m benchmarks.launches

TensorFlow: the ops of `optimizer.apply` traced in a `tf.function`
(without XLA), in its outer graph and in its branches' bodies, and its
conditionals (`If`). torch: the operators one `apply` dispatches (the
top-level `aten::` events of `torch.profiler`; on a GPU each is a kernel
launch or more), at each position in the window. A count, not a time:
it does not depend on what else runs on the machine.
"""

import argparse
import collections

import keras
import numpy as np

from accum_optimizers import AdamAccumulate
from benchmarks import workloads

K = 4
CONFIGS = {
    "parent": lambda: keras.optimizers.Adam(),
    "keras_builtin_k4": lambda: keras.optimizers.Adam(
        gradient_accumulation_steps=K
    ),
    "ours_k4": lambda: AdamAccumulate(accum_iters=K),
    "ours_k4_skip_noise": lambda: AdamAccumulate(
        accum_iters=K, skip_nonfinite=True, measure_noise_scale=True
    ),
}


def _variables_and_gradients():
    model = workloads.build("mlp")
    rng = np.random.default_rng(0)
    grads = [
        keras.ops.convert_to_tensor(
            (1e-3 * rng.normal(size=v.shape)).astype("float32")
        )
        for v in model.trainable_variables
    ]
    return model.trainable_variables, grads


def tensorflow_counts(make):
    """`{outer, in branches, If}` of a traced `apply`."""
    import tensorflow as tf

    variables, grads = _variables_and_gradients()
    optimizer = make()
    optimizer.build(variables)
    graph = (
        tf.function(lambda: optimizer.apply(grads, variables))
        .get_concrete_function()
        .graph.as_graph_def()
    )
    skipped = {"Placeholder", "Const", "NoOp", "Identity"}
    outer = collections.Counter(n.op for n in graph.node)
    inner = collections.Counter(
        n.op for f in graph.library.function for n in f.node_def
    )
    conditionals = sum(outer[op] + inner[op] for op in ("If", "StatelessIf"))
    return {
        "ops (outer graph)": sum(
            c for op, c in outer.items() if op not in skipped
        ),
        "ops in branches": sum(
            c for op, c in inner.items() if op not in skipped
        ),
        "If": conditionals,
    }


def torch_counts(make):
    """Operators dispatched by each call of a window: `{call j: count}`."""
    import torch

    variables, grads = _variables_and_gradients()
    optimizer = make()
    optimizer.build(variables)
    for _ in range(K):  # warm up: a whole window
        optimizer.apply(grads, variables)
    counts = {}
    for position in range(1, K + 1):
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ) as profile:
            optimizer.apply(grads, variables)
        counts[f"call {position}"] = sum(
            1
            for event in profile.events()
            if event.name.startswith("aten::") and event.cpu_parent is None
        )
    counts["per call (mean)"] = sum(counts.values()) / K
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    backend = keras.backend.backend()
    count = {"tensorflow": tensorflow_counts, "torch": torch_counts}.get(
        backend
    )
    if count is None:
        raise SystemExit(
            f"KERAS_BACKEND={backend}: counts TensorFlow's ops or torch's "
            "operators; XLA (JAX, TensorFlow with jit_compile) fuses them."
        )
    rows = {name: count(make) for name, make in CONFIGS.items()}
    columns = list(next(iter(rows.values())))
    print(f"| {backend} | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, counts in rows.items():
        cells = [f"{counts[c]:g}" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
