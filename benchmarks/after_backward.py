"""Keras' built-in accumulation made to wait for the whole backward pass:
the `keras_builtin_k4_after_backward` configuration (TensorFlow).

In a TensorFlow graph, Keras' `gradient_accumulation_steps` runs each
variable's add, and on a window's last micro-batch its update, as soon as
that variable's gradient exists, while the backward pass still computes
the others: an error later in the backward pass leaves the variables
already updated. Ours writes no weight before every gradient exists. This
configuration holds Keras' built-in to the same rule, so that the two
differ by their arithmetic alone. Elsewhere (XLA, JAX, torch) it is Keras'
built-in unchanged: compiled code schedules the writes itself, and eager
torch has every gradient before `apply` runs.
"""

import keras


def after_backward(parent):
    """A subclass of the Keras optimizer class `parent` whose `apply`
    starts only once every gradient of the step exists (a TensorFlow
    graph)."""

    class AfterBackward(parent):
        def apply(self, grads, trainable_variables=None):
            if keras.backend.backend() == "tensorflow":
                import tensorflow as tf

                if not tf.executing_eagerly():
                    present = [g for g in grads if g is not None]
                    with tf.control_dependencies(present):
                        grads = [
                            None if g is None else tf.identity(g) for g in grads
                        ]
            return super().apply(grads, trainable_variables)

    AfterBackward.__name__ = f"{parent.__name__}AfterBackward"
    return AfterBackward
