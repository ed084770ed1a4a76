"""Worker for test_noise_scale.py: `measure_noise_scale` under
`tf.distribute.MirroredStrategy` over 2 logical CPU devices, which it
refuses (naming the argument and the replica count).

    KERAS_BACKEND=tensorflow python noise_mirrored_worker.py OUT.json
"""

import json
import sys
from pathlib import Path

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

from helpers import regression_data  # noqa: E402
from helpers import small_model  # noqa: E402

from accum_optimizers import AdamAccumulate  # noqa: E402


def main(out):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = regression_data(0, 16)
    results = {"replicas": strategy.num_replicas_in_sync, "error": None}
    with strategy.scope():
        model = small_model(0)
        model.compile(
            optimizer=AdamAccumulate(accum_iters=2, measure_noise_scale=True),
            loss="mse",
        )
    try:
        model.fit(x, y, batch_size=4, verbose=0)
    except ValueError as error:
        results["error"] = str(error)
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
