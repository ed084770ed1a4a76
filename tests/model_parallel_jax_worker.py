"""Worker for test_model_parallel_jax.py: `ModelParallel` on a 2x4 mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 KERAS_BACKEND=jax \
        python model_parallel_jax_worker.py RESULT.json

Eight JAX devices exist only if `XLA_FLAGS` is set before JAX starts, hence
a process of its own. Under one `keras.distribution.ModelParallel` (a
("batch", "model") mesh of 2x4, a `LayoutMap` sharding every Dense kernel's
output axis over "model"), it trains

1. the parent Keras Adam on batches of `K * MICRO_BATCH`: the oracle;
2. `AdamAccumulate(accum_iters=K)` from the same initial weights, in the
   same data order, on micro-batches of `MICRO_BATCH`;

each model and optimizer made under the distribution's scope. It writes
both runs' weights, and for every device the bytes of the model's
trainable variables, of the parent's optimizer state and of ours, that the
device holds, to RESULT.json; and what `fit` does with an optimizer made
outside the scope.
"""

import json
import sys

import keras
import numpy as np
from helpers import regression_data
from helpers import small_model
from helpers import window_state

from accum_optimizers import AdamAccumulate

DEVICE_COUNT = 8
MESH = (2, 4)
K = 3
MICRO_BATCH = 8  # global: 4 samples per "batch" shard
WINDOWS = 2
SEED = 11
SHAPES = {"in_dim": 8, "hidden": 16, "out_dim": 8}


def distribution(devices):
    mesh = keras.distribution.DeviceMesh(MESH, ("batch", "model"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    # A key is a regex over the whole variable path.
    layout_map[".*dense.*/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def bytes_per_device(variables, devices):
    """`[bytes of `variables` held by device d for d in devices]`."""
    held = {device: 0 for device in devices}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return [held[device] for device in devices]


def train(optimizer, batch_size, initial_weights, x, y):
    model = small_model(SEED, **SHAPES)
    model.set_weights(initial_weights)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def main(result_path):
    import jax

    devices = jax.devices()
    if len(devices) != DEVICE_COUNT:
        raise SystemExit(
            f"expected {DEVICE_COUNT} JAX devices, found {devices}; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICE_COUNT}"
        )
    x, y = regression_data(
        SEED, WINDOWS * K * MICRO_BATCH, SHAPES["in_dim"], SHAPES["out_dim"]
    )
    initial_weights = small_model(SEED, **SHAPES).get_weights()
    with distribution(devices).scope():
        parent = keras.optimizers.Adam(learning_rate=0.01)
        parent_model = train(parent, K * MICRO_BATCH, initial_weights, x, y)
        ours = AdamAccumulate(learning_rate=0.01, accum_iters=K)
        our_model = train(ours, MICRO_BATCH, initial_weights, x, y)
        kernel_shardings = [
            str(v.value.sharding)
            for v in our_model.trainable_variables
            if v.name == "kernel"
        ]
        result = {
            "parent_weights": [w.tolist() for w in parent_model.get_weights()],
            "our_weights": [w.tolist() for w in our_model.get_weights()],
            "iterations": int(ours.iterations),
            "parent_iterations": int(parent.iterations),
            "kernel_shardings": kernel_shardings,
            "model_bytes": bytes_per_device(
                our_model.trainable_variables, devices
            ),
            "parent_state_bytes": bytes_per_device(parent.variables, devices),
            "our_state_bytes": bytes_per_device(ours.variables, devices),
            "sums_bytes": bytes_per_device(window_state(ours)["sums"], devices),
            "model_total_bytes": int(
                sum(np.prod(v.shape) * 4 for v in our_model.trainable_variables)
            ),
        }
    # The scope rule: an optimizer made outside the distribution's scope.
    outside = AdamAccumulate(learning_rate=0.01, accum_iters=K)
    try:
        with distribution(devices).scope():
            train(outside, MICRO_BATCH, initial_weights, x, y)
        result["made_outside"] = "trained"
    except Exception as error:  # noqa: BLE001 - recorded for the test
        result["made_outside"] = f"{type(error).__name__}: {error}"[:500]
    with open(result_path, "w") as result_file:
        json.dump(result, result_file)


if __name__ == "__main__":
    main(sys.argv[1])
