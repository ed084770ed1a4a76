"""The package's entry points, left as written by AutoGraph.

A user's `tf.function` around a custom training loop converts what it calls:
our methods would run rewritten there but not in `fit` (whose step AutoGraph
never converts, as it leaves Keras' own code), and the rewriting fails,
warning to report a bug, on a method whose body is only its docstring.
`tf.autograph.experimental.do_not_convert` marks each method a user calls;
what they call runs unconverted with them.
"""

import keras


def unconverted(function):
    """`function`, which AutoGraph calls as written (on TensorFlow; on the
    other backends, `function` itself: TensorFlow is not imported)."""
    if keras.backend.backend() != "tensorflow":
        return function
    import tensorflow as tf

    return tf.autograph.experimental.do_not_convert(function)
