"""Every private Keras (and TensorFlow) API this package relies on.

A Keras upgrade is one review of this list; `tests/test_keras_private.py`
checks that each of them still exists.

Attributes and methods of `keras.optimizers.Optimizer` used by the mixin
(`_accumulation.py`) and the backend classes (`_backend/`):

- `_iterations`: the update counter variable (`iterations` is a property
  that Keras' own accumulation divides).
- `_trainable_variables`, `_get_variable_index(variable)`,
  `_check_variables_are_known(variables)`: the variables the optimizer was
  built with, and the index of each.
- `_track_variable(variable)`: registers an optimizer variable.
- `_overwrite_variable_with_gradient(variable)`: float8 scale variables
  that the optimizer overwrites with their "gradient".
- `_get_current_learning_rate()`: the learning rate at `_iterations`.
- TensorFlow: `_distribution_strategy` and `_all_reduce_sum_gradients`
  (`keras/src/backend/tensorflow/optimizer.py`).
- torch: `TorchOptimizer.__new__` swaps in the fused
  (`torch._foreach_*`) variant of a Keras optimizer (`fused_class`).

TensorFlow internals: `control_flow_util.GraphOrParentsInXlaContext` and
`tf.__internal__.distribute.strategy_supports_no_merge_call`.
"""

OPTIMIZER_ATTRIBUTES = (
    "_iterations",
    "_trainable_variables",
    "_get_variable_index",
    "_check_variables_are_known",
    "_track_variable",
    "_overwrite_variable_with_gradient",
    "_get_current_learning_rate",
)

TENSORFLOW_OPTIMIZER_ATTRIBUTES = (
    "_distribution_strategy",
    "_all_reduce_sum_gradients",
)


def fused_class(optimizer_class):
    """The class Keras instantiates for `optimizer_class`.

    On torch, `TorchOptimizer.__new__` returns an instance of a fused
    (`torch._foreach_*`) variant for Keras' own optimizers, and only for the
    exact classes: a subclass of the plain class would silently run a
    per-variable loop. Asking `__new__` is asking Keras itself; elsewhere it
    returns `optimizer_class`.
    """
    return type(optimizer_class.__new__(optimizer_class))


def in_xla_context():
    """Whether the TensorFlow graph being built is compiled by XLA."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def strategy_needs_merge_call():
    """Whether Keras' update under the current strategy calls `merge_call`."""
    import tensorflow as tf

    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
        and not tf.__internal__.distribute.strategy_supports_no_merge_call()
    )
