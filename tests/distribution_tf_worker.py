"""Worker for test_distribution_tf.py: `tf.distribute.MirroredStrategy`.

    KERAS_BACKEND=tensorflow python distribution_tf_worker.py OUT.json

Over 2 logical CPU devices (`mirrored_devices`), runs every case below
and writes one JSON object of measurements to OUT.json; the test judges
them. The oracle of every equivalence case is the parent Keras
optimizer on one device (no strategy) with the global batch
`K * B * REPLICAS`.
"""

import json
import sys
from pathlib import Path

import tensorflow as tf
from mirrored_devices import DEVICES
from mirrored_devices import REPLICAS

# The CPU is split (above) before anything below starts TensorFlow.
# isort: split
import keras
import numpy as np
from helpers import PARENTS
from helpers import fit_in_order
from helpers import largest_difference
from helpers import regression_data
from helpers import small_model
from helpers import train_with_strategy

from accum_optimizers import AdamAccumulate
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate

K, B = 3, 4  # accum_iters, per-replica micro-batch
GLOBAL_MICRO = B * REPLICAS
WINDOWS = 2
N = K * GLOBAL_MICRO * WINDOWS
CONFIGS = {
    "adam": (AdamAccumulate, {"learning_rate": 0.01, "amsgrad": True}),
    "sgd": (SGDAccumulate, {"learning_rate": 0.1, "momentum": 0.9}),
    "rmsprop": (
        RMSpropAccumulate,
        {"learning_rate": 0.01, "centered": True, "momentum": 0.5},
    ),
    "adam_schedule_clip_decay_ema": (
        AdamAccumulate,
        {
            "learning_rate": keras.optimizers.schedules.ExponentialDecay(
                0.02, decay_steps=1, decay_rate=0.7
            ),
            "global_clipnorm": 0.5,
            "weight_decay": 0.05,
            # Keras' `ema_overwrite_frequency` puts a `merge_call` in an
            # `ops.cond` in replica context: the parent itself fails under
            # MirroredStrategy with it (docs/distributed.md).
            "use_ema": True,
        },
    ),
}


# The configuration whose parent, under the strategy, departs from the
# one-device run (it clips each replica's share of the gradient).
CLIPPED = "adam_schedule_clip_decay_ema"


_ORACLES = {}


def parent_weights(name, x, y):
    """The oracle: the parent on one device with the global batch (trained
    once per configuration: every case trains on the same data)."""
    if name not in _ORACLES:
        cls, kwargs = CONFIGS[name]
        model = small_model(0)
        model.compile(optimizer=PARENTS[cls](**kwargs), loss="mse")
        fit_in_order(model, x, y, batch_size=K * GLOBAL_MICRO)
        _ORACLES[name] = (x, model.get_weights())
    data, weights = _ORACLES[name]
    assert data is x
    return weights


def mirrored_model(strategy, name, jit_compile=False, accum_iters=K):
    cls, kwargs = CONFIGS[name]
    with strategy.scope():
        model = small_model(0)
        optimizer = (
            cls(accum_iters=accum_iters, **kwargs)
            if accum_iters
            else PARENTS[cls](**kwargs)
        )
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    return model


class CountAllReduces:
    """Counts, at run time, the cross-replica all-reduces that execute.

    Wraps `tf.distribute.ReplicaContext.all_reduce` (which Keras' TensorFlow
    optimizers and ours use to sum gradients over replicas) so that each
    replica adds one to a counter whenever a reduction runs; a reduction
    skipped by control flow is not counted.
    """

    def __enter__(self):
        self.counter = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._all_reduce = tf.distribute.ReplicaContext.all_reduce
        counter, all_reduce = self.counter, self._all_reduce

        def counting(context, reduce_op, value, options=None):
            with tf.control_dependencies([counter.assign_add(1)]):
                return all_reduce(context, reduce_op, value, options)

        tf.distribute.ReplicaContext.all_reduce = counting
        return self

    def __exit__(self, *exc_info):
        tf.distribute.ReplicaContext.all_reduce = self._all_reduce

    @property
    def count(self):
        return int(self.counter.numpy()) // REPLICAS


def fit_cases(results, strategy, x, y):
    for name in CONFIGS:
        model = mirrored_model(strategy, name)
        fit_in_order(model, x, y, batch_size=GLOBAL_MICRO)
        results[f"fit/{name}"] = {
            "max_difference": largest_difference(
                model.get_weights(), parent_weights(name, x, y)
            ),
            "iterations": int(model.optimizer.iterations.numpy()),
        }
        if name == CLIPPED:
            parent = mirrored_model(strategy, name, accum_iters=0)
            fit_in_order(parent, x, y, batch_size=K * GLOBAL_MICRO)
            results[f"fit/{name}"]["max_difference_to_mirrored_parent"] = (
                largest_difference(model.get_weights(), parent.get_weights())
            )


def jit_cases(results, x, y):
    # On CPU, XLA cannot reach variables on another logical device, so
    # Keras' own optimizers fail under a 2-device strategy with
    # jit_compile=True; record what the parent and ours do, and check the
    # XLA path (merge_call, gate) on a one-device MirroredStrategy.
    for devices in (DEVICES[:1], DEVICES):
        strategy = tf.distribute.MirroredStrategy(devices)
        outcome = {}
        for label, accum_iters in (("parent", 0), ("ours", K)):
            batch = K * B * len(devices) if label == "parent" else None
            model = mirrored_model(
                strategy, "adam", jit_compile=True, accum_iters=accum_iters
            )
            try:
                fit_in_order(model, x, y, batch_size=batch or B * len(devices))
            except Exception as error:  # noqa: BLE001 - recorded, judged
                outcome[label] = type(error).__name__
                continue
            outcome[label] = "ok"
            if label == "ours":
                outcome["max_difference"] = largest_difference(
                    model.get_weights(),
                    _parent_on(x, y, K * B * len(devices)),
                )
        results[f"jit/{len(devices)}_devices"] = outcome


def placed_case(results, x, y):
    # No strategy: a model whose layers lie on both devices, in a graph
    # without XLA, its close asked to compile (`jit_compile=True`). One XLA
    # computation cannot reach both, so the close runs as TensorFlow's ops.
    def placed_model(optimizer):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((x.shape[1],))
        with tf.device(DEVICES[0]):
            hidden = keras.layers.Dense(6, activation="tanh")(inputs)
        with tf.device(DEVICES[1]):
            outputs = keras.layers.Dense(y.shape[1])(hidden)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        return model

    cls, kwargs = CONFIGS["adam"]
    ours = fit_in_order(
        placed_model(cls(accum_iters=K, jit_compile=True, **kwargs)),
        x,
        y,
        batch_size=B,
    )
    parent = fit_in_order(
        placed_model(PARENTS[cls](**kwargs)), x, y, batch_size=K * B
    )
    results["placed/adam"] = {
        "devices": len({v.value.device for v in ours.trainable_variables}),
        "max_difference": largest_difference(
            ours.get_weights(), parent.get_weights()
        ),
        "iterations": int(ours.optimizer.iterations.numpy()),
    }


def _parent_on(x, y, batch):
    cls, kwargs = CONFIGS["adam"]
    model = small_model(0)
    model.compile(optimizer=PARENTS[cls](**kwargs), loss="mse")
    fit_in_order(model, x, y, batch_size=batch)
    return model.get_weights()


def custom_loop_case(results, strategy, x, y):
    with strategy.scope():
        model = small_model(0)
        optimizer = AdamAccumulate(accum_iters=K, **CONFIGS["adam"][1])
        optimizer.build(model.trainable_variables)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_MICRO)
    train_with_strategy(
        strategy,
        model,
        optimizer,
        strategy.experimental_distribute_dataset(dataset),
        GLOBAL_MICRO,
    )
    results["custom_loop/adam"] = {
        "max_difference": largest_difference(
            model.get_weights(), parent_weights("adam", x, y)
        ),
        "iterations": int(optimizer.iterations.numpy()),
    }


def reached_subsets_case(results, strategy):
    """A custom loop whose micro-steps reach different variables (one
    `tf.function` per pattern, as a Python branch retraces), AdamW: the
    closing call misses a variable reached earlier; a window reaches one
    variable only. Against Adam on one device fed each window's mean over
    the replicas (each replica's gradient the same, summed over them)."""
    reached = [(1, 1), (1, 0), (1, 0), (1, 0), (0, 1), (1, 0)]
    rng = np.random.default_rng(0)
    grads = [
        [rng.normal(size=3).astype("float32") for _ in "ab"] for _ in reached
    ]
    options = {"learning_rate": 0.1, "weight_decay": 0.1}
    with strategy.scope():
        ours = [keras.Variable(np.ones(3, "float32")) for _ in "ab"]
        optimizer = AdamAccumulate(accum_iters=2, **options)
        optimizer.build(ours)
    steps = {}
    for pattern, (g_a, g_b) in zip(reached, grads):
        if pattern not in steps:

            @tf.function
            def step(g_a, g_b, pattern=pattern):
                def replica_step(g_a, g_b):
                    passed = [
                        g if on else None for g, on in zip((g_a, g_b), pattern)
                    ]
                    optimizer.apply(passed, ours)

                strategy.run(replica_step, args=(g_a, g_b))

            steps[pattern] = step
        steps[pattern](tf.constant(g_a), tf.constant(g_b))
    theirs = [keras.Variable(np.ones(3, "float32")) for _ in "ab"]
    parent = keras.optimizers.Adam(**options)
    parent.build(theirs)
    replicas = strategy.num_replicas_in_sync
    for start in range(0, len(reached), 2):
        window = range(start, start + 2)
        indices = [i for i in range(2) if any(reached[j][i] for j in window)]
        means = [
            replicas * sum(grads[j][i] * reached[j][i] for j in window) / 2
            for i in indices
        ]
        parent.apply(
            [tf.constant(m) for m in means], [theirs[i] for i in indices]
        )
    results["custom_loop/reached_subsets"] = {
        "max_difference": largest_difference(
            [v.numpy() for v in ours], [v.numpy() for v in theirs]
        ),
        "iterations": int(optimizer.iterations.numpy()),
    }


def reduction_cases(results, strategy, x, y):
    counts = {}
    for label, accum_iters in (("parent", 0), ("ours", K)):
        model = mirrored_model(strategy, "sgd", accum_iters=accum_iters)
        with CountAllReduces() as all_reduces:
            fit_in_order(model, x, y, batch_size=GLOBAL_MICRO)
        counts[label] = all_reduces.count
    counts["micro_steps"] = N // GLOBAL_MICRO
    results["reductions"] = counts

    with strategy.scope():
        model = small_model(0)
        model.compile(
            optimizer=keras.optimizers.SGD(gradient_accumulation_steps=K),
            loss="mse",
        )
    try:
        fit_in_order(model, x, y, batch_size=GLOBAL_MICRO)
        results["keras_builtin"] = "ok"
    except Exception as error:  # noqa: BLE001 - recorded, judged
        results["keras_builtin"] = type(error).__name__


def ema_overwrite_case(results, strategy, x, y):
    """Records what Keras' `ema_overwrite_frequency` does under the strategy.

    Keras builds it as an `ops.cond` around a `merge_call` in replica
    context, which tf.distribute refuses; ours inherits it.
    """
    outcome = {}
    for label, accum_iters in (("parent", 0), ("ours", K)):
        cls, kwargs = CONFIGS["adam"]
        with strategy.scope():
            model = small_model(0)
            optimizer = PARENTS[cls] if not accum_iters else cls
            extra = {"accum_iters": accum_iters} if accum_iters else {}
            model.compile(
                optimizer=optimizer(
                    use_ema=True, ema_overwrite_frequency=2, **kwargs, **extra
                ),
                loss="mse",
            )
        try:
            fit_in_order(model, x, y, batch_size=GLOBAL_MICRO)
            outcome[label] = "ok"
        except Exception as error:  # noqa: BLE001 - recorded, judged
            outcome[label] = type(error).__name__
    results["ema_overwrite"] = outcome


def resume_case(results, strategy, directory, x, y):
    """Saves a `.keras` file mid-window under the strategy and resumes."""
    split = 2 * GLOBAL_MICRO + K * GLOBAL_MICRO  # one window + 2 pending
    model = mirrored_model(strategy, "adam")
    fit_in_order(model, x[:split], y[:split], batch_size=GLOBAL_MICRO)
    micro_steps_saved = int(model.optimizer.micro_steps.numpy())
    path = Path(directory) / "mid_window.keras"
    model.save(path)
    with strategy.scope():
        restored = keras.saving.load_model(path)
    fit_in_order(restored, x[split:], y[split:], batch_size=GLOBAL_MICRO)
    # The same file on one device: the pending window carries over.
    single = keras.saving.load_model(path)
    fit_in_order(single, x[split:], y[split:], batch_size=GLOBAL_MICRO)
    expected = parent_weights("adam", x, y)
    results["resume/adam"] = {
        "micro_steps_saved": micro_steps_saved,
        "max_difference": largest_difference(restored.get_weights(), expected),
        "max_difference_one_device": largest_difference(
            single.get_weights(), expected
        ),
    }


def flush_case(results, strategy, x, y):
    """A partial last window, flushed at the end of the epoch."""
    cut = N - GLOBAL_MICRO  # the last window has K - 1 micro-batches
    model = mirrored_model(strategy, "sgd")
    fit_in_order(model, x[:cut], y[:cut], batch_size=GLOBAL_MICRO, flush=True)
    cls, kwargs = CONFIGS["sgd"]
    oracle = small_model(0)
    oracle.compile(optimizer=PARENTS[cls](**kwargs), loss="mse")
    for start in (0, K * GLOBAL_MICRO):
        stop = min(start + K * GLOBAL_MICRO, cut)
        oracle.train_on_batch(x[start:stop], y[start:stop])
    results["flush/sgd"] = {
        "max_difference": largest_difference(
            model.get_weights(), oracle.get_weights()
        ),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def schedule_case(results, strategy, x, y):
    """A ramp `{0: 1, 1: n - 1}` over the `n` global micro-batches: one
    update on the first, one on the rest; oracle: the parent on one device
    on those two big batches."""
    micro_batches = len(x) // GLOBAL_MICRO
    with strategy.scope():
        model = small_model(0)
        model.compile(
            optimizer=AdamAccumulate(
                0.01, accum_iters={0: 1, 1: micro_batches - 1}
            ),
            loss="mse",
        )
    fit_in_order(model, x, y, batch_size=GLOBAL_MICRO)
    parent = small_model(0)
    parent.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    parent.train_on_batch(x[:GLOBAL_MICRO], y[:GLOBAL_MICRO])
    parent.train_on_batch(x[GLOBAL_MICRO:], y[GLOBAL_MICRO:])
    results["schedule"] = {
        "max_difference": largest_difference(
            model.get_weights(), parent.get_weights()
        ),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def main(out_path):
    x, y = regression_data(3, N)
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    results = {"replicas": strategy.num_replicas_in_sync}
    fit_cases(results, strategy, x, y)
    if "--fit-only" not in sys.argv:
        custom_loop_case(results, strategy, x, y)
        reached_subsets_case(results, strategy)
        reduction_cases(results, strategy, x, y)
        resume_case(results, strategy, Path(out_path).parent, x, y)
        flush_case(results, strategy, x, y)
        schedule_case(results, strategy, x, y)
        ema_overwrite_case(results, strategy, x, y)
        jit_cases(results, x, y)
        placed_case(results, x, y)
    with open(out_path, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
