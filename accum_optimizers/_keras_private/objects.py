"""Private attributes and methods of Keras objects (optimizers and their
wrappers, models, `BatchNormalization`), each read through a function
named for what it gives. Part of `_keras_private` (its docstring lists
what each is for); import them from there. `tests/test_keras_private.py`
checks every name below against the installed Keras."""

# -- keras.optimizers.Optimizer ------------------------------------------------

OPTIMIZER_ATTRIBUTES = (
    "_iterations",
    "_learning_rate",
    "_trainable_variables",
    "_variables",
    "_get_variable_index",
    "_check_variables_are_known",
    "_track_variable",
    "_overwrite_variable_with_gradient",
    "_apply_weight_decay",
)

# On TensorFlow; the second is TensorFlow's `Trackable`'s
# (`on_tensorflow_tracking`).
TENSORFLOW_OPTIMIZER_ATTRIBUTES = (
    "_distribution_strategy",
    "_maybe_initialize_trackable",
)

# Keras' private optimizer methods that `GradientAccumulation` overrides,
# each calling Keras' own through `super()` (on TensorFlow only, the
# second tuple). `tests/test_keras_private.py` checks that Keras still
# defines each, with our override's parameters, and that our classes
# override no other private Keras method.
OVERRIDDEN_OPTIMIZER_METHODS = (
    "_apply_weight_decay",
    "_get_current_learning_rate",
)
OVERRIDDEN_TENSORFLOW_OPTIMIZER_METHODS = ("_all_reduce_sum_gradients",)


def iterations_variable(optimizer):
    """The variable counting `optimizer`'s updates (`iterations` divides it
    by Keras' own `gradient_accumulation_steps`)."""
    return optimizer._iterations


def learning_rate_as_given(optimizer):
    """`optimizer`'s `learning_rate` as constructed (a number, a variable
    or a schedule; `None` before it is set): the `learning_rate` property
    gives its value now."""
    return getattr(optimizer, "_learning_rate", None)


def trainable_variables(optimizer):
    """The variables `optimizer` was built with, in the order of its
    indices."""
    return optimizer._trainable_variables


def own_variables(optimizer):
    """A wrapper optimizer's own variables (a `LossScaleOptimizer`'s
    `variables` lists its inner optimizer's after them)."""
    return optimizer._variables


def variable_index(optimizer, variable):
    """The index of `variable` among `optimizer`'s built variables."""
    return optimizer._get_variable_index(variable)


def check_variables_are_known(optimizer, variables):
    """Raises `ValueError` if one of `variables` is not one `optimizer`
    was built with."""
    optimizer._check_variables_are_known(variables)


def track_variable(optimizer, variable):
    """Makes `variable` one of `optimizer`'s variables (saved with it)."""
    optimizer._track_variable(variable)


def overwrites_with_gradient(optimizer, variable):
    """Whether `optimizer` overwrites `variable` with its "gradient" (a
    float8 scale) instead of updating it."""
    return optimizer._overwrite_variable_with_gradient(variable)


def distribution_strategy(optimizer):
    """TensorFlow: the `tf.distribute` strategy `optimizer` was made
    under."""
    return optimizer._distribution_strategy


# -- keras.Model ---------------------------------------------------------------

MODEL_ATTRIBUTES = (
    "_compute_loss_has_training_arg",
    "_get_metrics_result_or_logs",
)


def compute_loss_takes_training(model):
    """Whether `model.compute_loss` takes `training` (Keras calls an older
    override without it)."""
    return model._compute_loss_has_training_arg


def set_compute_loss_takes_training(model):
    """Has Keras call `model.compute_loss` with `training`."""
    model._compute_loss_has_training_arg = True


def call_before_epoch_logs(model, hook):
    """Has `hook()` run where every backend's `fit` ends an epoch's
    training loop: its `_get_metrics_result_or_logs`, called right after
    the last train step (after JAX puts the trained state back on the
    model) and before validation. On `model` only."""
    original = model._get_metrics_result_or_logs

    def get_metrics_result_or_logs(logs):
        hook()
        return original(logs)

    model._get_metrics_result_or_logs = get_metrics_result_or_logs


def stop_calling_before_epoch_logs(model):
    """Undoes `call_before_epoch_logs(model, ...)`."""
    del model._get_metrics_result_or_logs


# -- keras.layers.BatchNormalization -------------------------------------------

BATCH_NORMALIZATION_ATTRIBUTES = (
    "_reduction_axes",
    "_moments",
    "_renorm_correction_and_moments",
    "_compose_transforms",
    "_update_renorm_statistics",
)


def batch_norm_reduction_axes(layer):
    """The axes a `BatchNormalization` layer's statistics reduce over."""
    return layer._reduction_axes


def batch_norm_moments(layer, inputs, mask):
    """`(mean, variance)` of `inputs` (masked), as the layer takes them."""
    return layer._moments(inputs, mask)


def batch_norm_renorm_correction_and_moments(layer, mean, variance):
    """`(r, d, mean, variance)`: batch renormalization's correction."""
    return layer._renorm_correction_and_moments(mean, variance)


def batch_norm_compose_transforms(layer, r, d, gamma, beta, dtype):
    """`(gamma, beta)` composed with the renormalization's `r, d`."""
    return layer._compose_transforms(r, d, gamma, beta, dtype)


def batch_norm_update_renorm_statistics(layer, mean, variance):
    """Keras' update of the moving and renormalization statistics."""
    layer._update_renorm_statistics(mean, variance)
