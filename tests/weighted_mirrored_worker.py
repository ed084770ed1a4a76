"""Worker for test_weighted_distributed.py: weighted windows mirrored.

    KERAS_BACKEND=tensorflow python weighted_mirrored_worker.py OUT.json

Trains under `tf.distribute.MirroredStrategy` over 2 logical CPU devices
(`mirrored_devices`) with micro-batches that differ (a short last
micro-batch, sample weights, masked variable-length sequences)
and writes, for every case, the largest difference of the weights from
their oracle to OUT.json, as JSON; the test judges them.

The oracle is the parent Keras optimizer on one device, without a
strategy, from the same initial weights, on the window's concatenated big
batch, in the same order. Keras' `fit` under the strategy splits each
global micro-batch between the replicas with
`experimental_distribute_dataset`; `split` records how it splits a short
one, so that each window is known to hold exactly the samples of the
oracle's big batch.
"""

import json
import sys
from pathlib import Path

import tensorflow as tf
from mirrored_devices import DEVICES
from mirrored_devices import split_of_global_batches

# The CPU is split (above) before anything below starts TensorFlow.
# isort: split
import keras
import numpy as np
from helpers import PARENTS
from helpers import largest_difference
from helpers import regression_data
from helpers import sequence_data
from helpers import sequence_model
from helpers import small_model
from weighted_case import FitCase

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate

K = 3  # accum_iters
GLOBAL_MICRO = 8  # global micro-batch; 4 per replica
BIG = K * GLOBAL_MICRO
# One full window, then a flushed one of 8 and a short 5 (split 3 / 2).
N = BIG + GLOBAL_MICRO + 5
# As N, with a last micro-batch of 1 sample: the second replica gets none.
N_EMPTY_REPLICA = BIG + GLOBAL_MICRO + 1
# One strategy per process: with a second one, fit failed with mismatched
# collective ops (batchnorm_mirrored_worker.py).
STRATEGY = tf.distribute.MirroredStrategy(DEVICES)

OPTIMIZERS = {
    "adam": (AdamAccumulate, {"learning_rate": 0.01}),
    # Keras' TensorFlow Adam updates an embedding's `IndexedSlices`
    # gradient with repeated indices unlike its dense sum (the window's
    # mean), so the parent's big batch is no oracle for Adam there.
    "sgd_momentum": (SGDAccumulate, {"learning_rate": 0.1, "momentum": 0.9}),
}


FIT_CASES = {
    "sample_weight_sum_over_batch_size_empty_replica": FitCase(
        "dense", "sum_over_batch_size", N_EMPTY_REPLICA
    ),
    "sample_weight_mean_with_sample_weight": FitCase(
        "dense", "mean_with_sample_weight", N
    ),
    "masked_sequences": FitCase("sequences", "sum_over_batch_size", N),
}


def per_replica(values):
    """A distributed value holding `values[r]` on replica r."""
    return STRATEGY.experimental_distribute_values_from_function(
        lambda context: tf.constant(values[context.replica_id_in_sync_group])
    )


def recorded(measure):
    """`measure()`, or the error it raised, for the test to judge."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - recorded, judged
        return {"error": f"{type(error).__name__}: {error}"[:500]}


def fit_case(name):
    case = FIT_CASES[name]
    x, _, sample_weight = case.data()
    split = split_of_global_batches(STRATEGY, case.samples, GLOBAL_MICRO)
    ours_cls, kwargs = OPTIMIZERS[
        "adam" if case.kind == "dense" else "sgd_momentum"
    ]
    parent_cls = PARENTS[ours_cls]
    initial = case.model().get_weights()

    oracle = case.model()
    oracle.compile(optimizer=parent_cls(**kwargs), loss=case.loss())
    case.fit(oracle, BIG)
    result = {
        "split": split,
        # Per micro-batch, each replica's normalizer: where they differ,
        # an unweighed window is not the big batch.
        "normalizers": [
            [case.normalizer(x, sample_weight, shard) for shard in batch]
            for batch in split
        ],
        "scale": largest_difference(oracle.get_weights(), initial),
        "oracle_iterations": int(oracle.optimizer.iterations.numpy()),
    }

    def fit():
        with STRATEGY.scope():
            model = case.model()
            model.compile(
                optimizer=ours_cls(accum_iters=K, **kwargs), loss=case.loss()
            )
        case.fit(model, GLOBAL_MICRO, weighed=True)
        return {
            "max_difference": largest_difference(
                model.get_weights(), oracle.get_weights()
            ),
            "iterations": int(model.optimizer.iterations.numpy()),
        }

    result.update(recorded(fit))
    return result


# Per window, per micro-batch: the samples each replica gets, uneven.
# (3, 0): the second replica's shard is empty, its weight 0.
CUSTOM_SHARDS = [[(4, 4), (3, 0), (2, 5)], [(1, 3), (4, 2), (5, 5)]]


def custom_loop_case(kind):
    """`strategy.run` of a step that weighs each replica's gradients by its
    own count of samples (`dense`) or valid tokens (`sequences`)."""
    samples = sum(a + b for window in CUSTOM_SHARDS for a, b in window)
    if kind == "dense":
        x, y = regression_data(2, samples)
        make_model, optimizer = small_model, "adam"

        def losses(model, xb, yb):
            values = tf.reduce_mean(tf.square(model(xb) - yb), axis=-1)
            return values, tf.ones_like(values)

    else:
        x, y = sequence_data(3, samples)
        make_model, optimizer = sequence_model, "sgd_momentum"

        def losses(model, xb, yb):
            values = keras.losses.sparse_categorical_crossentropy(
                yb, model(xb), from_logits=True
            )
            return values, tf.cast(tf.not_equal(xb, 0), values.dtype)

    ours_cls, kwargs = OPTIMIZERS[optimizer]
    parent_cls = PARENTS[ours_cls]
    initial = make_model(0).get_weights()

    # The oracle: the parent on the mean loss over each window's samples
    # (tokens).
    oracle = make_model(0)
    parent = parent_cls(**kwargs)
    start = 0
    for window in CUSTOM_SHARDS:
        stop = start + sum(a + b for a, b in window)
        with tf.GradientTape() as tape:
            values, valid = losses(oracle, x[start:stop], y[start:stop])
            loss = tf.reduce_sum(values * valid) / tf.reduce_sum(valid)
        parent.apply(
            tape.gradient(loss, oracle.trainable_variables),
            oracle.trainable_variables,
        )
        start = stop
    result = {"scale": largest_difference(oracle.get_weights(), initial)}

    def train():
        with STRATEGY.scope():
            model = make_model(0)
            ours = ours_cls(accum_iters=K, **kwargs)
            ours.build(model.trainable_variables)

        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                values, valid = losses(model, xb, yb)
                count = tf.reduce_sum(valid)
                # The replica's mean loss over its own samples (tokens),
                # divided by the number of replicas, as Keras' losses are.
                loss = tf.math.divide_no_nan(
                    tf.reduce_sum(values * valid), count
                )
                loss = loss / STRATEGY.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            ours.apply(grads, model.trainable_variables, weight=count)

        @tf.function(reduce_retracing=True)
        def step(xb, yb):
            STRATEGY.run(replica_step, args=(xb, yb))

        start = 0
        for sizes in sum(CUSTOM_SHARDS, []):
            ends = start + np.cumsum(sizes)
            shards = [slice(end - n, end) for end, n in zip(ends, sizes)]
            step(
                per_replica([x[shard] for shard in shards]),
                per_replica([y[shard] for shard in shards]),
            )
            start = int(ends[-1])
        return {
            "max_difference": largest_difference(
                model.get_weights(), oracle.get_weights()
            ),
            "iterations": int(ours.iterations.numpy()),
        }

    result.update(recorded(train))
    return result


def main(out_path):
    results = {"replicas": STRATEGY.num_replicas_in_sync}
    for name in FIT_CASES:
        results[f"fit/{name}"] = fit_case(name)
    for kind in ("dense", "sequences"):
        results[f"custom_loop/{kind}"] = custom_loop_case(kind)
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
