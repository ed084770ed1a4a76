"""TensorFlow pieces of the accumulation mechanism (see `__init__`)."""

import tensorflow as tf
from keras import ops


def fused_parent(parent):
    return parent


def add_into(optimizer, accumulators, grads):
    # `optimizer.assign_add` scatters `tf.IndexedSlices` (embedding
    # gradients) instead of densifying them.
    for accumulator, grad in zip(accumulators, grads):
        optimizer.assign_add(accumulator, grad)


def zero(variables):
    for variable in variables:
        variable.assign(ops.zeros(variable.shape, variable.dtype))


def run_if(optimizer, pred, fn):
    if tf.executing_eagerly():
        if bool(pred):
            fn()
        return

    def run():
        fn()
        return tf.constant(True)

    # The false branch does nothing: the update math lives only in `run`,
    # so a micro-step that only accumulates never executes it.
    tf.cond(pred, run, lambda: tf.constant(False))
