"""TensorFlow's answers to what `_backend/__init__.py` exports."""

import tensorflow as tf

from accum_optimizers import _keras_private
from accum_optimizers._backend import runtime_defaults

# XLA's memory analysis of a step is JAX's alone (`compiled_peak`).
SUPPORTS_MEMORY_ANALYSIS = False

# The parent optimizer's graph adds 1 to `iterations` without waiting for
# the step's gradients: a step that fails may have counted an update it
# did not apply.
COUNTS_ITERATIONS_BEFORE_UPDATE = True

# A step that fails may have written part of its state.
FAILED_STEP_WRITES_NO_STATE = False

# A graph adds each gradient into its sum as the backward pass produces it
# and counts the micro-batch once every gradient exists: a step that fails
# may have written sums it did not count.
FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS = True

# torch's compiler alone retraces per micro-batch (`weigh_micro_batches`).
COMPILER_RETRACES_EACH_HAND_OVER = False

# An Embedding's gradient is an `IndexedSlices`, which Keras' optimizers
# apply per row (`check_exactness`' diagnosis).
EMBEDDING_GRADIENTS_ARE_SPARSE = True

# tf.distribute reduces once per window on its own.
NEEDS_WINDOW_SYNC = False


def is_out_of_memory(error):
    """Whether `error` is TensorFlow's `ResourceExhaustedError`.

    Args:
        error: an exception.
    """
    return isinstance(error, tf.errors.ResourceExhaustedError)


def free_device_memory():
    """Frees the device memory a failed step held: TensorFlow's allocator
    keeps its blocks."""


def _gpu():
    return bool(tf.config.list_logical_devices("GPU"))


def reset_allocator_peak():
    """Restarts the first GPU's peak allocation, if there is a GPU."""
    if _gpu():
        tf.config.experimental.reset_memory_stats("GPU:0")


def allocator_peak():
    """The first GPU's peak allocation in bytes since
    `reset_allocator_peak`, or `None` without a GPU."""
    if not _gpu():
        return None
    return int(tf.config.experimental.get_memory_info("GPU:0")["peak"])


def asserted_normalizer(weight, skips, message):
    """`(weight, checked, poisoned)` for `weigh_micro_batches`: a graph
    assertion that `weight` is finite and >= 0 (or, with `skips`, not
    finite), or `None` where the graph cannot fail (under XLA).

    Args:
        weight: the micro-batch's traced loss normalizer.
        skips: whether a non-finite `weight` marks a micro-batch to skip.
        message: the assertion's message.
    """
    if _keras_private.in_xla_context():
        return None
    valid = tf.math.is_finite(weight) & (weight >= 0)
    allowed = valid | (skips & ~tf.math.is_finite(weight))
    check = tf.debugging.Assert(
        allowed, [f"{message} Received: normalizer=", weight]
    )
    with tf.control_dependencies([check]):
        weight = tf.identity(weight)
    if skips:
        weight = tf.where(valid, weight, float("nan"))
    return weight, lambda: tf.control_dependencies([check]), skips


def quiet_python_logger():
    """Only errors from TensorFlow's Python logger."""
    tf.get_logger().setLevel("ERROR")


# What this backend has nothing to give for.
compiled_peak = runtime_defaults.compiled_peak
random_state = runtime_defaults.random_state
set_random_state = runtime_defaults.set_random_state
