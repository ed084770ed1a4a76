"""Worker for test_noise_scale_distributed.py: `measure_noise_scale` under
`tf.distribute.MirroredStrategy` over 2 logical CPU devices.

    KERAS_BACKEND=tensorflow python noise_mirrored_worker.py OUT.json

For each case it writes what the optimizer reads out after each window,
and, for the oracle, every replica's share of each of the window's
micro-batches: its weight and its mean gradient, computed by a plain Keras
model (outside the strategy) at the weights the window started from. The
test recomputes each window's two estimates from those in numpy.

- `fit`: `weigh_micro_batches`, `mean_with_sample_weight` (each share's
  weight is the sum of its sample weights, some 0), `skip_nonfinite` with
  a NaN sample in one replica's share, and a flushed last window whose
  last micro-batch holds one sample (the second replica's share empty,
  weight 0), in a graph (TensorFlow cannot XLA-compile a mirrored train
  step on CPU: distribution_tf_worker.py records it).
- `custom_loop`: `strategy.run` in a `tf.function`, unweighted.
- `multi_optimizer`: the same loop through a `MultiOptimizer` of two
  measuring optimizers.
- `adascale_unweighted`: the same loop with `SGDAccumulate` and an AdaScale
  rate whose `base_batch_size` is `REPLICAS` (one global micro-batch:
  unweighted, each replica's share counts 1), with the weights before and
  after each window.
- `rule_unweighted`, `rule_weighted`: the same loop with `SGDAccumulate`
  without measuring and a scaling rule on an `ExponentialDecay` base:
  `linear_scaling` with a warm-up, unweighted (`base_batch_size=REPLICAS`),
  and `sqrt_scaling` with each replica's `apply(..., weight=n_r)` on
  uneven shares (3 and 5 samples) and a third, short window flushed after
  the loop; with the weights before and after each window.
"""

import json
import sys
from pathlib import Path

import tensorflow as tf
from mirrored_devices import DEVICES
from mirrored_devices import REPLICAS
from mirrored_devices import split_of_global_batches

# The CPU is split (above) before anything below starts TensorFlow.
# isort: split
import keras
import numpy as np
from helpers import regression_data
from helpers import sample_weights
from helpers import small_model

import accum_optimizers
from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import weigh_micro_batches

MOMENTUM = 0.5  # noise_scale_momentum: every window counts
GLOBAL_MICRO = 8  # 4 per replica
# fit: 8 micro-batches of 8, then one of 1 (split 1 / 0).
FIT_SAMPLES = 8 * GLOBAL_MICRO + 1
FIT_K = 3
FIT_BASE_BATCH = 4.0  # AdaScale's base batch, in samples
SKIPPED = 4  # its first sample is NaN: the first replica's share
FIT_WINDOWS = [[0, 1, 2], [3, 5, 6], [7, 8]]  # the last one flushed
LOOP_K = 2
LOOP_MICRO_BATCHES = 4
READ_OUTS = (
    "window_gradient_sq_norm",
    "window_noise_trace",
    "gradient_sq_norm",
    "gradient_noise_trace",
    "noise_scale",
    "adascale_gain",
    "window_scale",
    "scale_invariant_step",
)
# One strategy per process (batchnorm_mirrored_worker.py).
STRATEGY = tf.distribute.MirroredStrategy(DEVICES)


def read_outs(optimizer):
    values = {
        name: float(keras.ops.convert_to_numpy(getattr(optimizer, name)))
        for name in READ_OUTS
    }
    for name in ("iterations", "skipped_micro_batches", "samples_seen"):
        values[name] = float(
            keras.ops.convert_to_numpy(getattr(optimizer, name))
        )
    return values


def share_gradient(model, weights, x, y, sample_weight):
    """`(weight, gradients)` of one replica's share of a micro-batch at
    `weights`: the sum of its sample weights and the gradient of its
    `mean_with_sample_weight` MSE, one flat list per variable (`None` for
    weight 0: no sample)."""
    weight = float(np.sum(sample_weight, dtype="float64"))
    if weight == 0:
        return weight, None
    model.set_weights(weights)
    with tf.GradientTape() as tape:
        values = tf.reduce_mean(tf.square(model(x) - y), axis=-1)
        loss = tf.reduce_sum(values * sample_weight) / tf.reduce_sum(
            sample_weight
        )
    grads = tape.gradient(loss, model.trainable_variables)
    return weight, [g.numpy().ravel().tolist() for g in grads]


def recorded(measure):
    """`measure()`, or the error it raised, for the test to judge."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - recorded, judged
        return {"error": f"{type(error).__name__}: {error}"[:800]}


class _Recorder(keras.callbacks.Callback):
    """The weights before each micro-batch, the read-outs after it."""

    def __init__(self):
        super().__init__()
        self.weights, self.after = {}, {}

    def on_train_batch_begin(self, batch, logs=None):
        self.weights[batch] = self.model.get_weights()

    def on_train_batch_end(self, batch, logs=None):
        self.after[batch] = read_outs(self.model.optimizer)


def fit_case():
    x, y = regression_data(0, FIT_SAMPLES)
    x[SKIPPED * GLOBAL_MICRO, 0] = np.nan
    sample_weight = sample_weights(0, FIT_SAMPLES)
    split = split_of_global_batches(STRATEGY, FIT_SAMPLES, GLOBAL_MICRO)
    with STRATEGY.scope():
        model = small_model(0)
        optimizer = SGDAccumulate(
            learning_rate=accum_optimizers.schedules.adascale(
                0.05, base_batch_size=FIT_BASE_BATCH
            ),
            momentum=0.9,
            accum_iters=FIT_K,
            skip_nonfinite=True,
            measure_noise_scale=True,
            noise_scale_momentum=MOMENTUM,
        )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.MeanSquaredError(
                reduction="mean_with_sample_weight"
            ),
            jit_compile=False,
        )
    weigh_micro_batches(model)
    recorder = _Recorder()
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=GLOBAL_MICRO,
        shuffle=False,
        verbose=0,
        callbacks=[recorder, FlushAccumulation()],
    )
    plain = small_model(0)
    windows = []
    for number, window in enumerate(FIT_WINDOWS):
        start = recorder.weights[window[0]]
        shares = [
            share_gradient(
                plain, start, x[shard], y[shard], sample_weight[shard]
            )
            for j in window
            for shard in split[j]
        ]
        last = number == len(FIT_WINDOWS) - 1
        windows.append(
            {
                "shares": shares,
                # The last window is applied by the flush, after `fit`.
                "ours": read_outs(optimizer)
                if last
                else recorder.after[window[-1]],
            }
        )
    return {
        "split": split,
        "windows": windows,
        "samples": int(sum(len(s) for b in split for s in b)),
    }


ADASCALE_RATE = 0.1


def loop_case(multi, adascale=False):
    """`strategy.run` of an unweighted step: each replica's mean MSE over
    its share of 4 samples, divided by the replica count as Keras' losses
    are."""
    x, y = regression_data(1, LOOP_MICRO_BATCHES * GLOBAL_MICRO)
    y = y + 2.0  # a true gradient that stands out of the noise: |G|^2 > 0
    with STRATEGY.scope():
        model = small_model(0)
        if multi:
            inner = [
                SGDAccumulate(
                    0.1,
                    accum_iters=LOOP_K,
                    measure_noise_scale=True,
                    noise_scale_momentum=MOMENTUM,
                ),
                AdamAccumulate(
                    0.01,
                    accum_iters=LOOP_K,
                    measure_noise_scale=True,
                    noise_scale_momentum=MOMENTUM,
                ),
            ]
            optimizer = keras.optimizers.MultiOptimizer(
                keras.optimizers.OptimizerMap(inner[0], {".*bias": inner[1]})
            )
        elif adascale:
            # One global micro-batch: `REPLICAS` shares of weight 1.
            rate = accum_optimizers.schedules.adascale(
                ADASCALE_RATE, base_batch_size=REPLICAS
            )
            inner = [
                SGDAccumulate(
                    rate,
                    accum_iters=LOOP_K,
                    measure_noise_scale=True,
                    noise_scale_momentum=MOMENTUM,
                )
            ]
            optimizer = inner[0]
        else:
            inner = [
                AdamAccumulate(
                    0.01,
                    accum_iters=LOOP_K,
                    measure_noise_scale=True,
                    noise_scale_momentum=MOMENTUM,
                )
            ]
            optimizer = inner[0]
        optimizer.build(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
            loss = loss / STRATEGY.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    @tf.function
    def step(xb, yb):
        STRATEGY.run(replica_step, args=(xb, yb))

    def per_replica(values):
        return STRATEGY.experimental_distribute_values_from_function(
            lambda context: tf.constant(
                values[context.replica_id_in_sync_group]
            )
        )

    share = GLOBAL_MICRO // REPLICAS
    plain = small_model(0)
    windows = []
    for first in range(0, LOOP_MICRO_BATCHES, LOOP_K):
        start = model.get_weights()
        shards = [
            np.arange(
                j * GLOBAL_MICRO + r * share, j * GLOBAL_MICRO + (r + 1) * share
            )
            for j in range(first, first + LOOP_K)
            for r in range(REPLICAS)
        ]
        for j in range(first, first + LOOP_K):
            mine = shards[(j - first) * REPLICAS : (j - first + 1) * REPLICAS]
            step(
                per_replica([x[s] for s in mine]),
                per_replica([y[s] for s in mine]),
            )
        windows.append(
            {
                # Unweighted: each share counts 1.
                "shares": [
                    (
                        1.0,
                        share_gradient(
                            plain, start, x[s], y[s], np.ones(share, "float32")
                        )[1],
                    )
                    for s in shards
                ],
                "ours": [read_outs(o) for o in inner],
                "start": [w.ravel().tolist() for w in start],
                "end": [w.ravel().tolist() for w in model.get_weights()],
            }
        )
    return {
        "windows": windows,
        "paths": [v.path for v in model.trainable_variables],
    }


RULE_RATE = 0.1  # the base schedule: RULE_RATE * RULE_DECAY ** tau
RULE_DECAY = 0.8
RULE_WARMUP = 3.0  # linear_scaling's warm-up, in base steps
RULE_WEIGHTED_BASE = 6.0  # sqrt_scaling's base batch, in samples
RULE_WEIGHTED_SPLIT = (3, 5)  # each replica's share of a micro-batch


def rule_case(weighted):
    """`strategy.run` of a step whose learning rate is a scaling rule's:
    unweighted (even shares, each counting 1) or weighted (each replica's
    `apply(..., weight=n_r)`, uneven shares), then a flushed window of one
    micro-batch where weighted."""
    x, y = regression_data(2, (LOOP_MICRO_BATCHES + 1) * GLOBAL_MICRO)
    base = keras.optimizers.schedules.ExponentialDecay(
        RULE_RATE, decay_steps=1, decay_rate=RULE_DECAY
    )
    if weighted:
        rate = accum_optimizers.schedules.sqrt_scaling(
            base, base_batch_size=RULE_WEIGHTED_BASE
        )
        sizes = RULE_WEIGHTED_SPLIT
    else:
        # One global micro-batch: `REPLICAS` shares of weight 1.
        rate = accum_optimizers.schedules.linear_scaling(
            base, base_batch_size=REPLICAS, warmup_steps=RULE_WARMUP
        )
        sizes = (GLOBAL_MICRO // REPLICAS,) * REPLICAS
    with STRATEGY.scope():
        model = small_model(0)
        optimizer = SGDAccumulate(rate, accum_iters=LOOP_K)
        optimizer.build(model.trainable_variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
            loss = loss / STRATEGY.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        weight = tf.cast(tf.shape(xb)[0], "float32") if weighted else None
        optimizer.apply(grads, model.trainable_variables, weight=weight)

    @tf.function
    def step(xb, yb):
        STRATEGY.run(replica_step, args=(xb, yb))

    def per_replica(values):
        return STRATEGY.experimental_distribute_values_from_function(
            lambda context: tf.constant(
                values[context.replica_id_in_sync_group]
            )
        )

    ends = np.cumsum(sizes)
    plain = small_model(0)
    windows = []
    bounds = [(0, LOOP_K), (LOOP_K, 2 * LOOP_K)]
    if weighted:
        bounds.append((2 * LOOP_K, 2 * LOOP_K + 1))  # flushed
    for first, stop in bounds:
        start = model.get_weights()
        shards = [
            [
                np.arange(j * GLOBAL_MICRO + e - n, j * GLOBAL_MICRO + e)
                for e, n in zip(ends, sizes)
            ]
            for j in range(first, stop)
        ]
        for mine in shards:
            step(
                per_replica([x[s] for s in mine]),
                per_replica([y[s] for s in mine]),
            )
        if stop - first < LOOP_K:
            optimizer.flush()
        windows.append(
            {
                # `(weight, mean gradient)` of each share: its sample count
                # weighted, 1 unweighted.
                "shares": [
                    (
                        float(len(s)) if weighted else 1.0,
                        share_gradient(
                            plain, start, x[s], y[s], np.ones(len(s), "float32")
                        )[1],
                    )
                    for mine in shards
                    for s in mine
                ],
                "ours": read_outs(optimizer),
                "start": [w.ravel().tolist() for w in start],
                "end": [w.ravel().tolist() for w in model.get_weights()],
            }
        )
    return {"windows": windows}


def main(out):
    results = {
        "replicas": STRATEGY.num_replicas_in_sync,
        "imported_from": accum_optimizers.__file__,
        "momentum": MOMENTUM,
        "fit_base_batch": FIT_BASE_BATCH,
        "fit": recorded(fit_case),
        "custom_loop": recorded(lambda: loop_case(multi=False)),
        "multi_optimizer": recorded(lambda: loop_case(multi=True)),
        "adascale_unweighted": recorded(
            lambda: loop_case(multi=False, adascale=True)
        ),
        "adascale_rate": ADASCALE_RATE,
        "rule": {
            "rate": RULE_RATE,
            "decay": RULE_DECAY,
            "warmup": RULE_WARMUP,
            "weighted_base": RULE_WEIGHTED_BASE,
        },
        "rule_unweighted": recorded(lambda: rule_case(weighted=False)),
        "rule_weighted": recorded(lambda: rule_case(weighted=True)),
    }
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
