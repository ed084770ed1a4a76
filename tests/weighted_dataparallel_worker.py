"""Worker for test_weighted_distributed.py: weighted windows data-parallel.

    KERAS_BACKEND=jax python weighted_dataparallel_worker.py OUT.json

Fits with `weigh_micro_batches` under `keras.distribution.DataParallel`,
over the 2 JAX CPU devices `run_jax_worker` gives it, with
micro-batches that differ (a short last micro-batch, sample weights,
masked variable-length sequences), and writes, for every case, the largest
difference of the weights from their oracle to OUT.json, as JSON: the
parent Keras optimizer on one device, from the same initial weights, on
the window's concatenated big batch, in the same order. Arrays are global
under `keras.distribution`: a micro-batch's loss, and so its weight, is
that of the global micro-batch.
"""

import json
import sys
from pathlib import Path

import jax
import keras
from helpers import largest_difference
from weighted_case import FitCase

from accum_optimizers import AdamAccumulate

K, GLOBAL_MICRO = 3, 8  # accum_iters, global micro-batch (4 per device)
BIG = K * GLOBAL_MICRO
# One full window, then a flushed one of 8 and a short 6: Keras shards
# only batches the devices divide evenly.
N = BIG + GLOBAL_MICRO + 6
ADAM = {"learning_rate": 0.01}
LENGTH = 6  # of the sequences (`helpers.sequence_data`)

CASES = {
    "sample_weight_sum_over_batch_size": FitCase(
        "dense", "sum_over_batch_size", N
    ),
    "sample_weight_mean_with_sample_weight": FitCase(
        "dense", "mean_with_sample_weight", N
    ),
    # JAX differentiates an embedding densely: Adam's big batch is an
    # oracle here.
    "masked_sequences": FitCase("sequences", "sum_over_batch_size", N),
}


def run_case(name, devices):
    case = CASES[name]
    x, _, sample_weight = case.data()

    oracle = case.model()
    initial = oracle.get_weights()
    oracle.compile(optimizer=keras.optimizers.Adam(**ADAM), loss=case.loss())
    case.fit(oracle, BIG)

    distribution = keras.distribution.DataParallel(devices=devices)
    with distribution.scope():
        model = case.model()
        model.set_weights(initial)
        model.compile(
            optimizer=AdamAccumulate(accum_iters=K, **ADAM), loss=case.loss()
        )
        case.fit(model, GLOBAL_MICRO, weighed=True)
        data_layout = distribution.get_data_layout((GLOBAL_MICRO, LENGTH))
    starts = range(0, N, GLOBAL_MICRO)
    return {
        # Per micro-batch, its normalizer: where they differ in a window,
        # an unweighed window is not the big batch.
        "normalizers": [
            case.normalizer(x, sample_weight, slice(i, i + GLOBAL_MICRO))
            for i in starts
        ],
        "data_layout_axes": list(data_layout.axes),
        "max_difference": largest_difference(
            model.get_weights(), oracle.get_weights()
        ),
        "scale": largest_difference(oracle.get_weights(), initial),
        "iterations": int(model.optimizer.iterations),
        "oracle_iterations": int(oracle.optimizer.iterations),
    }


def main(out):
    devices = jax.devices()
    results = {"devices": len(devices)}
    for name in CASES:
        results[name] = run_case(name, devices)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
