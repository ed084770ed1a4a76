"""Worker for test_batchnorm.py: `AccumBatchNormalization` data-parallel.

    KERAS_BACKEND=jax python batchnorm_dataparallel_worker.py OUT.json

Fits an input-normalizing model under `keras.distribution.DataParallel`
over the 2 JAX CPU devices `run_jax_worker` gives it and writes
the largest difference of its moving statistics from a one-device
`BatchNormalization` on the global big batch to OUT.json, as JSON.
"""

import json
import sys
from pathlib import Path

import jax
import keras
import numpy as np

from accum_optimizers import AccumBatchNormalization
from accum_optimizers import AdamAccumulate

K, B = 3, 8  # accum_iters, global micro-batch
MOMENTUM = 0.7


def main(out):
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    # The last micro-batch is short (6); Keras shards only even splits.
    n = K * B * 2 - 2
    rng = np.random.default_rng(0)
    x = (3.0 + 2.0 * rng.normal(size=(n, 3))).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    layer = AccumBatchNormalization(accum_iters=K, momentum=MOMENTUM)
    model = keras.Sequential([keras.Input((3,)), layer, keras.layers.Dense(1)])
    model.compile(optimizer=AdamAccumulate(accum_iters=K), loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    keras.distribution.set_distribution(None)
    oracle = keras.layers.BatchNormalization(momentum=MOMENTUM)
    for start in range(0, n, K * B):
        oracle(x[start : start + K * B], training=True)
    difference = max(
        float(np.abs(np.asarray(getattr(layer, name)) - expected).max())
        for name, expected in (
            ("moving_mean", np.asarray(oracle.moving_mean)),
            ("moving_variance", np.asarray(oracle.moving_variance)),
        )
    )
    results = {"devices": len(jax.devices()), "difference": difference}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
