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


def split_of_global_batches(strategy, samples, global_batch):
    """Per global micro-batch of `global_batch` of `samples` samples, the
    sample indices each replica of `strategy` gets from
    `experimental_distribute_dataset`, which `fit` uses."""
    dataset = tf.data.Dataset.range(samples).batch(global_batch)
    return [
        [t.numpy().tolist() for t in strategy.experimental_local_results(b)]
        for b in strategy.experimental_distribute_dataset(dataset)
    ]
