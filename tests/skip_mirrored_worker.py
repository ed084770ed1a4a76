"""Worker for test_skip_distributed.py: `skip_nonfinite` mirrored.

    KERAS_BACKEND=tensorflow python skip_mirrored_worker.py OUT.json

Fits `skip_case` under `tf.distribute.MirroredStrategy`, in a graph (on CPU,
TensorFlow's XLA cannot compile a mirrored train step, the parent's
neither: distribution_tf_worker.py records it); writes what it measured to
OUT.json, as JSON.
"""

import json
import sys
from pathlib import Path

import tensorflow as tf
from mirrored_devices import DEVICES

# The CPU is split (above) before anything below starts TensorFlow.
# isort: split
import skip_case

STRATEGY = tf.distribute.MirroredStrategy(DEVICES)


def main(out):
    results = {"replicas": STRATEGY.num_replicas_in_sync}
    try:
        results["graph"] = skip_case.fit(STRATEGY.scope, jit_compile=False)
    except Exception as error:  # noqa: BLE001 (reported to the test)
        results["graph"] = {"error": f"{type(error).__name__}: {error}"}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
