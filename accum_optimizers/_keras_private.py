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

Attributes and methods of `keras.layers.BatchNormalization` used by
`AccumBatchNormalization` (`layers.py`), which replaces the moving-statistics
update of its training branch: `_reduction_axes`, `_moments(inputs, mask)`,
and for `renorm=True` `_renorm_correction_and_moments`,
`_compose_transforms` and `_update_renorm_statistics`.

Loss internals used by `weigh_micro_batches` (`weighting.py`): see
`LOSS_MODULE_FUNCTIONS` below.
"""

import contextlib
import threading

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

BATCH_NORMALIZATION_ATTRIBUTES = (
    "_moments",
    "_renorm_correction_and_moments",
    "_compose_transforms",
    "_update_renorm_statistics",
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


# -- `weigh_micro_batches` (weighting.py) ------------------------------------
#
# Keras' `Loss.__call__` reduces through the module function
# `keras.src.losses.loss.reduce_weighted_values(values, sample_weight, mask,
# reduction, dtype)`; while a micro-batch's loss is computed, a wrapper
# records each call's arguments, from which `weighting.py` reads the count
# the loss was divided by, with Keras' own `apply_mask` and
# `squeeze_or_expand_to_same_rank`. `Trainer._compute_loss_has_training_arg`
# says whether `compute_loss` takes `training`.

LOSS_MODULE_FUNCTIONS = (
    "reduce_weighted_values",
    "apply_mask",
    "squeeze_or_expand_to_same_rank",
    "standardize_reduction",
)

TRAINER_ATTRIBUTES = (
    "_compute_loss_has_training_arg",
    # `FlushAccumulation` (callbacks.py): every backend's `fit` calls it
    # after an epoch's last train step, before validation.
    "_get_metrics_result_or_logs",
    # `sublayers` below.
    "_flatten_layers",
)


def sublayers(layer):
    """Every layer inside `layer`, as Keras tracks them: in nested models
    and in custom layers' attributes (`Layer._flatten_layers`)."""
    return layer._flatten_layers(include_self=False, recursive=True)


class LossReduction:
    """The arguments of one `reduce_weighted_values` call."""

    def __init__(self, values, sample_weight, mask, reduction, dtype):
        self.values = values
        self.sample_weight = sample_weight
        self.mask = mask
        self.reduction = reduction
        self.dtype = dtype


_recording = threading.local()
_patch_lock = threading.Lock()
_patch_state = {"depth": 0, "original": None}


def loss_module():
    from keras.src.losses import loss

    return loss


@contextlib.contextmanager
def recorded_loss_reductions():
    """Context that yields the list of `LossReduction`s of the Keras losses
    computed inside it, in this thread."""
    module = loss_module()
    records = []
    stack = getattr(_recording, "stack", None)
    if stack is None:
        stack = _recording.stack = []
    stack.append(records)
    with _patch_lock:
        if _patch_state["depth"] == 0:
            _patch_state["original"] = module.reduce_weighted_values
            module.reduce_weighted_values = _recording_reduce_weighted_values
        _patch_state["depth"] += 1
    try:
        yield records
    finally:
        stack.pop()
        with _patch_lock:
            _patch_state["depth"] -= 1
            if _patch_state["depth"] == 0:
                module.reduce_weighted_values = _patch_state["original"]


def _recording_reduce_weighted_values(
    values,
    sample_weight=None,
    mask=None,
    reduction="sum_over_batch_size",
    dtype=None,
):
    stack = getattr(_recording, "stack", None)
    if stack:
        stack[-1].append(
            LossReduction(values, sample_weight, mask, reduction, dtype)
        )
    return _patch_state["original"](
        values,
        sample_weight=sample_weight,
        mask=mask,
        reduction=reduction,
        dtype=dtype,
    )
