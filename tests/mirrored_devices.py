"""The logical CPU devices of the `tf.distribute.MirroredStrategy` workers.

Importing this module, before anything starts TensorFlow's runtime, splits
the CPU into `REPLICAS` logical devices (TensorFlow fixes its devices when
it starts), named `DEVICES`. A worker imports it first:

    from mirrored_devices import DEVICES  # isort: split
"""

import tensorflow as tf

REPLICAS = 2
DEVICES = [f"/cpu:{i}" for i in range(REPLICAS)]

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
)
