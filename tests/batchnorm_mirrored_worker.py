"""Worker for test_batchnorm.py: `AccumBatchNormalization` mirrored.

    KERAS_BACKEND=tensorflow python batchnorm_mirrored_worker.py OUT.json

Fits input-normalizing models under `tf.distribute.MirroredStrategy` over 2
logical CPU devices (`mirrored_devices`) and writes the largest differences
from their oracles to OUT.json, as JSON.
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

from accum_optimizers import AccumBatchNormalization
from accum_optimizers import AdamAccumulate

K, B = 3, 4  # accum_iters, per-replica micro-batch
GLOBAL_MICRO = B * REPLICAS
MOMENTUM = 0.7
# One strategy per process: with a second one, fit here failed with
# mismatched collective ops.
STRATEGY = tf.distribute.MirroredStrategy(DEVICES)


def _data(n):
    rng = np.random.default_rng(0)
    x = (3.0 + 2.0 * rng.normal(size=(n, 3))).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _model(layer):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(1)])


def _fit_mirrored(synchronized, x, y):
    with STRATEGY.scope():
        model = _model(
            AccumBatchNormalization(
                accum_iters=K, momentum=MOMENTUM, synchronized=synchronized
            )
        )
        model.compile(optimizer=AdamAccumulate(accum_iters=K), loss="mse")
    model.fit(x, y, batch_size=GLOBAL_MICRO, shuffle=False, verbose=0)
    return model.layers[0]


def _replica_values(variable):
    return [v.numpy() for v in variable.value.values]


def _stats(layer):
    return np.stack([layer.moving_mean.numpy(), layer.moving_variance.numpy()])


def synchronized_equals_one_device_big_batch():
    # 45 samples: the last global micro-batch of 5 splits 3 / 2.
    x, y = _data(K * GLOBAL_MICRO * 2 - 3)
    ours = _fit_mirrored(True, x, y)
    oracle = keras.layers.BatchNormalization(momentum=MOMENTUM)
    for start in range(0, len(x), K * GLOBAL_MICRO):
        oracle(x[start : start + K * GLOBAL_MICRO], training=True)
    replicas = [
        np.stack(pair)
        for pair in zip(
            _replica_values(ours.moving_mean),
            _replica_values(ours.moving_variance),
        )
    ]
    return max(float(np.abs(r - _stats(oracle)).max()) for r in replicas)


def unsynchronized_replicas_pool_their_own_shards():
    x, y = _data(K * GLOBAL_MICRO * 2)
    ours = _fit_mirrored(False, x, y)
    difference = 0.0
    for replica in range(REPLICAS):
        # Each global micro-batch is split in order: replica r gets the
        # r-th block of B samples.
        shards = x.reshape(-1, REPLICAS, B, 3)[:, replica]
        oracle = keras.layers.BatchNormalization(momentum=MOMENTUM)
        for window in shards.reshape(-1, K * B, 3):
            oracle(window, training=True)
        ours_replica = np.stack(
            [
                _replica_values(ours.moving_mean)[replica],
                _replica_values(ours.moving_variance)[replica],
            ]
        )
        difference = max(
            difference, float(np.abs(ours_replica - _stats(oracle)).max())
        )
    return difference


if __name__ == "__main__":
    results = {
        "replicas": len(tf.config.list_logical_devices("CPU")),
        "synchronized": synchronized_equals_one_device_big_batch(),
        "unsynchronized": unsynchronized_replicas_pool_their_own_shards(),
    }
    Path(sys.argv[1]).write_text(json.dumps(results))
