"""One process of `benchmarks/weighted.py`: weighted and unweighted windows
on one backend mode, side by side.

On the MLP of `workloads.py` (micro-batch 32, Adam), from the same initial
weights:

- `fit`: Keras' `train_step`, compiled as `model.fit` compiles it (see
  `window_steps.step_runner`), of the parent `Adam`; of `AdamAccumulate`
  with `accum_iters=4`; of the same with `weigh_micro_batches(model)`,
  whose step hands the micro-batch's loss normalizer (here its 32 samples)
  to the optimizer.
- `loop`: `AdamAccumulate(accum_iters=4)` in a custom training step,
  compiled as the backend compiles one (`tf.function`, with `jit_compile`
  in `tensorflow-xla`; `jax.jit` around `stateless_apply`; torch eagerly),
  calling `optimizer.apply(grads, variables)`, or the same with
  `weight=32` (a traced scalar on TensorFlow and JAX, a Python number on
  torch).

Each configuration is warmed up (`fit`, compilation, both branches of the
window), then `--rounds` interleaved rounds time one window of every
configuration, on the same micro-batch. Prints one JSON record per
configuration: ms per micro-step in each round, and the optimizer's total
weight after the first micro-batch of a window, which shows that the
weighted path ran (32 with a weight of 32, 1 without).
"""

import argparse
import functools
import json
import os
import time

import keras
from keras import ops

from accum_optimizers import AdamAccumulate
from accum_optimizers import weigh_micro_batches
from benchmarks import window_steps
from benchmarks import workloads

K = 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CONFIGS = [
    ("fit", "parent"),
    ("fit", "unweighted"),
    ("fit", "weighted"),
    ("loop", "unweighted"),
    ("loop", "weighted"),
]


def total_weight(optimizer):
    window = getattr(optimizer, "_window", None)
    if window is None:
        return None
    return float(ops.convert_to_numpy(window.total_weight.value))


def fit_step(config, x, y, batch, mode):
    """Returns `(step, weight_after_one)`: `step()` runs one micro-step of
    Keras' `train_step` as `fit` compiles it; `weight_after_one` is the
    optimizer's total weight after one micro-batch of
    `model.train_on_batch`."""
    model = workloads.build("mlp")
    optimizer = (
        keras.optimizers.Adam()
        if config == "parent"
        else AdamAccumulate(accum_iters=K)
    )
    xla = mode == "tensorflow-xla"
    jit_compile = xla if mode.startswith("tensorflow") else "auto"
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=jit_compile)
    if config == "weighted":
        weigh_micro_batches(model)
    model.fit(x, y, batch_size=batch, verbose=0)  # builds every variable
    weight_after_one = None
    for position in range(K):
        model.train_on_batch(x[:batch], y[:batch])
        if position == 0:
            weight_after_one = total_weight(model.optimizer)
    step, _ = window_steps.step_runner(model, (x[:batch], y[:batch]), xla)
    for _ in range(K):  # compiles it
        step()
    return step, weight_after_one


def loop_step(config, x, y, batch, mode):
    """Returns `(step, weight_after_one)` as `fit_step`, for a custom
    training step calling `optimizer.apply` (with `weight=batch` if `config` is
    `"weighted"`)."""
    model = workloads.build("mlp")
    optimizer = AdamAccumulate(accum_iters=K)
    optimizer.build(model.trainable_variables)
    x, y = ops.convert_to_tensor(x[:batch]), ops.convert_to_tensor(y[:batch])
    weighted = config == "weighted"
    backend = keras.backend.backend()
    if backend == "torch":
        step = _torch_step(model, optimizer, x, y, batch if weighted else None)
        read = lambda: total_weight(optimizer)  # noqa: E731
    elif backend == "jax":
        step, read = _jax_step(model, optimizer, x, y, batch, weighted)
    else:
        step = _tensorflow_step(model, optimizer, x, y, batch, weighted, mode)
        read = lambda: total_weight(optimizer)  # noqa: E731
    step()
    weight_after_one = read()
    for _ in range(K - 1):
        step()
    return step, weight_after_one


def _tensorflow_step(model, optimizer, x, y, batch, weighted, mode):
    import tensorflow as tf

    variables = model.trainable_variables
    weight = tf.constant(float(batch))

    @tf.function(jit_compile=mode == "tensorflow-xla")
    def step(x, y, weight):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        optimizer.apply(grads, variables, weight=weight if weighted else None)

    return lambda: step(x, y, weight)


def _jax_step(model, optimizer, x, y, batch, weighted):
    import jax

    def loss_fn(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        return LOSS(y, y_pred), non_trainable

    gradient = jax.value_and_grad(loss_fn, has_aux=True)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, x, y, weight):
        trainable, non_trainable, optimizer_state = state
        (_, non_trainable), grads = gradient(trainable, non_trainable, x, y)
        trainable, optimizer_state = optimizer.stateless_apply(
            optimizer_state,
            grads,
            trainable,
            weight=weight if weighted else None,
        )
        return [trainable, non_trainable, optimizer_state]

    state = [
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    ]
    weight = jax.numpy.asarray(float(batch))
    index = [id(v) for v in optimizer.variables].index(
        id(optimizer._window.total_weight)
    )

    def run():
        state[:] = step(state, x, y, weight)
        jax.block_until_ready(state)

    return run, lambda: float(state[2][index])


def _torch_step(model, optimizer, x, y, weight):
    import torch

    variables = model.trainable_variables

    def step():
        # Keras' own torch `train_step`, with `weight=`.
        loss = LOSS(y, model(x, training=True))
        model.zero_grad()
        loss.backward()
        grads = [v.value.grad for v in variables]
        with torch.no_grad():
            optimizer.apply(grads, variables, weight=weight)

    return step


def window_seconds(step):
    start = time.perf_counter()
    for _ in range(K):
        step()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    batch, fit_steps, smoke_steps = workloads.WORKLOADS["mlp"]
    fit_steps = smoke_steps if args.smoke else fit_steps
    x, y = workloads.data("mlp", fit_steps * batch)
    steps, weights_after_one = {}, {}
    for group, config in CONFIGS:
        make = fit_step if group == "fit" else loop_step
        steps[group, config], weights_after_one[group, config] = make(
            config, x, y, batch, args.mode
        )
    # A round times one window of every configuration, back to back, in an
    # order that rotates: short rounds put a slow spell of a shared machine
    # on both sides of a ratio.
    seconds = {key: [] for key in steps}
    keys = list(steps)
    for round_index in range(args.rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            seconds[key].append(window_seconds(steps[key]))
    for group, config in keys:
        record = {
            "mode": args.mode,
            "backend": keras.backend.backend(),
            "group": group,
            "config": config,
            "ms_per_step": [s / K * 1e3 for s in seconds[group, config]],
            "total_weight_after_one": weights_after_one[group, config],
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
