"""The case both `skip_nonfinite` distribution workers fit
(skip_mirrored_worker.py, skip_dataparallel_worker.py): data with one NaN
sample in micro-batch `SKIPPED`, in the second half of it, so that only
the second replica's (or device's) shard gets NaN gradients.

The oracle is the parent Keras optimizer on one device, without a
distribution, from the same initial weights, fitted on the big batches
made of the remaining micro-batches.
"""

import contextlib

import keras
import numpy as np
from helpers import largest_difference
from helpers import regression_data
from helpers import small_model

from accum_optimizers import AdamAccumulate

K = 2  # accum_iters
GLOBAL_MICRO = 8  # 4 per replica
MICRO_BATCHES = 7
SKIPPED = 2


def data():
    x, y = regression_data(3, MICRO_BATCHES * GLOBAL_MICRO)
    x[SKIPPED * GLOBAL_MICRO + GLOBAL_MICRO - 1, 0] = np.nan
    return x, y


def fit(scope=contextlib.nullcontext, jit_compile="auto"):
    """Fits the case in `scope` (a strategy's); returns what the test
    judges: the largest difference from the oracle, how far the weights
    moved, the optimizer's counters and what they should be."""
    x, y = data()
    with scope():
        model = small_model(0)
        optimizer = AdamAccumulate(
            learning_rate=0.01, accum_iters=K, skip_nonfinite=True
        )
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=GLOBAL_MICRO, shuffle=False, verbose=0)
    counters = {
        name: int(keras.ops.convert_to_numpy(getattr(optimizer, name)))
        for name in ("iterations", "skipped_micro_batches", "micro_steps")
    }
    weights = model.get_weights()

    kept = np.concatenate(
        [
            np.arange(n * GLOBAL_MICRO, (n + 1) * GLOBAL_MICRO)
            for n in range(MICRO_BATCHES)
            if n != SKIPPED
        ]
    )
    keras.distribution.set_distribution(None)
    reference = small_model(0)
    reference.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="mse"
    )
    reference.fit(
        x[kept], y[kept], batch_size=K * GLOBAL_MICRO, shuffle=False, verbose=0
    )
    finite = MICRO_BATCHES - 1
    return {
        "max_difference": largest_difference(weights, reference.get_weights()),
        "scale": largest_difference(
            reference.get_weights(), small_model(0).get_weights()
        ),
        "expected_iterations": finite // K,
        "expected_micro_steps": finite % K,
        **counters,
    }
