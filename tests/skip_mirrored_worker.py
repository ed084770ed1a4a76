"""Worker for test_skip_distributed.py: `skip_nonfinite` mirrored.

    KERAS_BACKEND=tensorflow python skip_mirrored_worker.py OUT.json

Splits the CPU into 2 logical devices (before TensorFlow starts) and fits
`skip_case` under `tf.distribute.MirroredStrategy`, in a graph (on CPU,
TensorFlow's XLA cannot compile a mirrored train step, the parent's
neither: distribution_tf_worker.py records it); writes what it measured to
OUT.json, as JSON.
"""

import json
import sys
from pathlib import Path

import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import skip_case  # noqa: E402

STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def main(out):
    results = {"replicas": STRATEGY.num_replicas_in_sync}
    try:
        results["graph"] = skip_case.fit(STRATEGY.scope, jit_compile=False)
    except Exception as error:  # noqa: BLE001 (reported to the test)
        results["graph"] = {"error": f"{type(error).__name__}: {error}"}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
