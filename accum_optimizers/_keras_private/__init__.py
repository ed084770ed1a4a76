"""Every private Keras (and backend) API this package relies on.

Each is reached through a function here named for what it gives, and
nowhere else; `docs/design.md` ("Keras' private names") says why each is
needed, one line each. A Keras upgrade is one review of this package;
`tests/test_keras_private.py` checks every listed name against the
installed Keras (failing with its version), exercises the behaviour relied
on, and scans the package for a private Keras name reached elsewhere.
Differences between Keras versions are handled here (`versions.py`: the
supported range, and the optimizers added after 3.10 in
`OPTIMIZERS_ADDED_IN`) and nowhere else.

The names, by where they are:

- `objects.py`: private attributes and methods of Keras' optimizers, their
  wrappers, models and `BatchNormalization` (`OPTIMIZER_ATTRIBUTES`,
  `MODEL_ATTRIBUTES`, `BATCH_NORMALIZATION_ATTRIBUTES`, ...), and the
  private optimizer methods `GradientAccumulation` overrides
  (`OVERRIDDEN_OPTIMIZER_METHODS`).
- here: `MultiOptimizer`'s variable map (`multi_optimizer_groups`), a
  variable's layout (`variable_layout`), the weight decay of one variable
  (`decay_weight`), torch's fused classes (`fused_class`), and the
  backends' internals: TensorFlow's `GraphOrParentsInXlaContext`,
  `strategy_supports_no_merge_call` and XLA's barrier, `jax.core.Tracer`,
  torch's in-place `_foreach_*` functions.
- `training.py`: the loss reductions `weigh_micro_batches` records, the
  trainer internals of `fit_to_memory`, and for `check_exactness` Keras'
  global `SeedGenerator`, `Functional` models and `compile`'s unserialized
  arguments.
- `frames.py`: what is read from the calling frames, where Keras hands
  nothing: a train step's loss, the wrappers taking an optimizer.

Behaviour of Keras' optimizers and trainers relied on (public names):

- `stateless_apply` (JAX, torch) calls `self.apply` inside a
  `StatelessScope`, so the accumulating `apply` runs there too.
- `fit`'s train step calls `optimizer.scale_loss(loss)`, then
  `optimizer.apply(...)` for the same micro-batch on the same thread
  (`weigh_micro_batches` hands the weight from one to the other, and the
  optimizer the loss, for `window_loss`). On JAX `scale_loss` runs inside
  `jax.value_and_grad`: the loss is read from the train step's local
  `unscaled_loss` instead (`jax_train_step_loss`). On TensorFlow, where a
  wrapper met inside the step (a `MultiOptimizer` mapped by a function)
  handed no loss on: the step's `loss`, unscaled
  (`tensorflow_train_step_loss`).
- `MultiOptimizer` (`optimizers`, `apply`, `scale_loss`) and
  `LossScaleOptimizer` (`inner_optimizer`, `apply`, `stateless_apply`,
  `scale_loss`): an instance that takes an accumulating optimizer
  cooperates with it (`_wrappers.py`), met where their methods set its
  `loss_scale_factor` (`wrappers_taking_an_optimizer`:
  `LossScaleOptimizer.__init__`, `build`; `MultiOptimizer.__init__`,
  `build`, its `loss_scale_factor` setter), the only time a wrapper hands
  an inner optimizer anything before training; on TensorFlow, a
  `MultiOptimizer` meets the `LossScaleOptimizer` that tracks it
  (`on_tensorflow_tracking`: TensorFlow's `_maybe_initialize_trackable`).
"""

import sys

import keras

# Optimizers that wrap other optimizers, where the installed Keras has them
# (`MultiOptimizer` arrived in 3.15.0).
_WRAPPER_NAMES = ("LossScaleOptimizer", "MultiOptimizer")


def keras_optimizer_classes():
    """`{name: class}` of the optimizers `keras.optimizers` exports, wrappers
    (`LossScaleOptimizer`, `MultiOptimizer`) and the base class left out."""
    wrappers = wrapper_optimizer_classes()
    classes = {}
    for name, value in vars(keras.optimizers).items():
        if (
            isinstance(value, type)
            and issubclass(value, keras.optimizers.Optimizer)
            and value is not keras.optimizers.Optimizer
            and not issubclass(value, wrappers)
        ):
            classes[name] = value
    return dict(sorted(classes.items()))


def is_multi_optimizer(optimizer):
    """Whether `optimizer` is a `keras.optimizers.MultiOptimizer` (False
    where the installed Keras has none)."""
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    return multi is not None and isinstance(optimizer, multi)


def multi_optimizer_groups(multi, grads, variables):
    """`[(inner optimizer, its grads, its variables)]`, in the order in
    which the built `MultiOptimizer` `multi`'s `apply` hands `grads` on,
    an inner optimizer with none of `variables` left out (from its
    `_var_to_optimizer_idx`, keyed by `_var_key`)."""
    groups = [([], []) for _ in multi.optimizers]
    for grad, variable in zip(grads, variables):
        index = multi._var_to_optimizer_idx[multi._var_key(variable)]
        groups[index][0].append(grad)
        groups[index][1].append(variable)
    return [
        (inner, inner_grads, inner_variables)
        for inner, (inner_grads, inner_variables) in zip(
            multi.optimizers, groups
        )
        if inner_variables
    ]


def wrapper_optimizer_classes():
    """The optimizer wrappers the installed Keras has, as a tuple."""
    return tuple(
        getattr(keras.optimizers, name)
        for name in _WRAPPER_NAMES
        if hasattr(keras.optimizers, name)
    )


MULTI_OPTIMIZER_ATTRIBUTES = ("_var_to_optimizer_idx", "_var_key")

VARIABLE_ATTRIBUTES = ("_layout",)


def public_name(optimizer_class):
    """`keras.optimizers.<Name>` for an optimizer class Keras defines (in
    its private `keras.src.optimizers` package), else the class' module
    and name."""
    name = optimizer_class.__name__
    if optimizer_class.__module__.startswith("keras.src.optimizers."):
        return f"keras.optimizers.{name}"
    return f"{optimizer_class.__module__}.{name}"


def fused_class(optimizer_class):
    """The class Keras instantiates for `optimizer_class`.

    On torch, `TorchOptimizer.__new__` returns an instance of a fused
    (`torch._foreach_*`) variant for Keras' own optimizers, and only for the
    exact classes: a subclass of the plain class would silently run a
    per-variable loop. Asking `__new__` is asking Keras itself; elsewhere it
    returns `optimizer_class`.
    """
    return type(optimizer_class.__new__(optimizer_class))


def decay_weight(optimizer, variable):
    """The parent optimizer's decoupled weight decay of one variable, as its
    `_apply_weight_decay([variable])` applies it, but for a backend's own
    override (TensorFlow's adds a `merge_call` under `tf.distribute`,
    which cannot run inside a branch): the base class' then."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    parent = getattr(type(optimizer), "parent_class", None) or type(optimizer)
    owner = next(
        cls for cls in parent.__mro__ if "_apply_weight_decay" in vars(cls)
    )
    if owner.__module__.startswith("keras.src.backend."):
        owner = BaseOptimizer
    else:
        # A parent's own decay (Muon's) reads the `keras.Variable` (its
        # path), where TensorFlow's update passes its `tf.Variable`.
        index = variable_index(optimizer, variable)
        variable = trainable_variables(optimizer)[index]
    owner._apply_weight_decay(optimizer, [variable])


def variable_layout(variable):
    """The `keras.distribution` layout of `variable` (`None` without one,
    or for a variable that is not a `keras.Variable`)."""
    return getattr(variable, "_layout", None)


def batch_norm_renorm(layer):
    """Whether a `BatchNormalization` layer uses batch renormalization
    (`False` on Keras < 3.14, which has none)."""
    return bool(getattr(layer, "renorm", False))


def in_stateless_scope():
    """Whether variables' writes go to a `keras.StatelessScope` (JAX's
    train step, eagerly too), to be taken only when the step completes."""
    from keras.src.backend.common.stateless_scope import (
        in_stateless_scope as in_scope,
    )

    return in_scope()


def in_tf_graph():
    """Whether a TensorFlow graph is being built (a `tf.function`, or
    `tf.data`'s), where a tensor has no value to read."""
    from keras.src.utils.backend_utils import in_tf_graph as in_graph

    return in_graph()


def torch_compiling():
    """Whether torch.compile is tracing (`jit_compile=True` on torch),
    where a tensor's value read on the host would be a graph break, and
    every branch on it a guard that recompiles the step when it changes."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def torch_host_value(value):
    """`value` as a numpy array where it is a torch tensor numpy holds, in
    one copy to the host (eager torch has no graph: it always has a
    value); else `None`. Without `convert_to_numpy`'s checks, a dispatch
    each on the micro-step's path."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    if value.requires_grad:
        value = value.detach()
    try:
        return value.cpu().numpy()
    except (TypeError, RuntimeError):  # bfloat16, float8; a fake tensor
        return None


def is_jax_tracer(value):
    """Whether `value` is a JAX tracer (inside `jax.jit`, a loop body...)."""
    import jax

    return isinstance(value, jax.core.Tracer)


# torch's in-place multi-tensor kernels, which Keras' fused torch optimizers
# use too: one call for every variable instead of a loop.
TORCH_FOREACH_FUNCTIONS = (
    "_foreach_add_",
    "_foreach_div_",
    "_foreach_zero_",
    "_foreach_copy_",
)


def torch_foreach_add_(targets, sources, alpha=1):
    """`targets[i] += alpha * sources[i]`, in place (torch tensors)."""
    import torch

    torch._foreach_add_(targets, sources, alpha=alpha)


def torch_foreach_div_(tensors, divisor):
    """`tensors[i] /= divisor`, in place (a number or a scalar tensor)."""
    import torch

    torch._foreach_div_(tensors, divisor)


def torch_foreach_zero_(tensors):
    """`tensors[i] = 0`, in place."""
    import torch

    torch._foreach_zero_(tensors)


def torch_foreach_copy_(targets, sources):
    """`targets[i][...] = sources[i]`, in place."""
    import torch

    torch._foreach_copy_(targets, sources)


def torch_foreach_sums_of_squares(tensors):
    """A float32 vector, the sum of squares of each of `tensors`: on a GPU
    one fused norm for float32 tensors, then its square; on the CPU a
    BLAS dot of each float32 tensor with itself, which reads memory
    faster than torch's norm there; a float32 norm of each other (float64
    ones in float64: torch refuses to narrow them)."""
    import torch

    if all(t.dtype == torch.float32 for t in tensors):
        if tensors[0].device.type == "cpu":
            flat = [t.reshape(-1) for t in tensors]
            return torch.stack([torch.dot(f, f) for f in flat])
        return torch.stack(torch._foreach_norm(tensors)).square()
    norms = [
        torch.linalg.vector_norm(t).float()
        if t.dtype == torch.float64
        else torch.linalg.vector_norm(t, dtype=torch.float32)
        for t in tensors
    ]
    return torch.stack(norms).square()


def in_xla_context():
    """Whether the TensorFlow graph being built is compiled by XLA."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def xla_unfused(tensor):
    """`tensor`, which XLA computes apart from what reads it (its
    `opt-barrier`): not fused into its consumers."""
    return xla_barrier(tensor)[0]


def xla_barrier(*tensors):
    """`tensors` through one XLA `opt-barrier`: each comes out depending
    on all of them, and XLA moves no computation across it."""
    from tensorflow.compiler.tf2xla.python import xla

    return list(xla.optimization_barrier(*tensors))


def strategy_needs_merge_call():
    """Whether Keras' update under the current strategy calls `merge_call`."""
    import tensorflow as tf

    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
        and not tf.__internal__.distribute.strategy_supports_no_merge_call()
    )


# Private attributes and methods of Keras objects (optimizers, models,
# `BatchNormalization`) are in `objects.py`; its names are this module's too.
from accum_optimizers._keras_private import objects as _objects  # noqa: E402

OPTIMIZER_ATTRIBUTES = _objects.OPTIMIZER_ATTRIBUTES
TENSORFLOW_OPTIMIZER_ATTRIBUTES = _objects.TENSORFLOW_OPTIMIZER_ATTRIBUTES
OVERRIDDEN_OPTIMIZER_METHODS = _objects.OVERRIDDEN_OPTIMIZER_METHODS
OVERRIDDEN_TENSORFLOW_OPTIMIZER_METHODS = (
    _objects.OVERRIDDEN_TENSORFLOW_OPTIMIZER_METHODS
)
MODEL_ATTRIBUTES = _objects.MODEL_ATTRIBUTES
BATCH_NORMALIZATION_ATTRIBUTES = _objects.BATCH_NORMALIZATION_ATTRIBUTES
iterations_variable = _objects.iterations_variable
learning_rate_as_given = _objects.learning_rate_as_given
trainable_variables = _objects.trainable_variables
own_variables = _objects.own_variables
variable_index = _objects.variable_index
check_variables_are_known = _objects.check_variables_are_known
track_variable = _objects.track_variable
overwrites_with_gradient = _objects.overwrites_with_gradient
distribution_strategy = _objects.distribution_strategy
compute_loss_takes_training = _objects.compute_loss_takes_training
set_compute_loss_takes_training = _objects.set_compute_loss_takes_training
call_before_epoch_logs = _objects.call_before_epoch_logs
stop_calling_before_epoch_logs = _objects.stop_calling_before_epoch_logs
batch_norm_reduction_axes = _objects.batch_norm_reduction_axes
batch_norm_moments = _objects.batch_norm_moments
batch_norm_renorm_correction_and_moments = (
    _objects.batch_norm_renorm_correction_and_moments
)
batch_norm_compose_transforms = _objects.batch_norm_compose_transforms
batch_norm_update_renorm_statistics = (
    _objects.batch_norm_update_renorm_statistics
)

# The trainer side (loss reductions, `fit` internals, global random state)
# is in `training.py`; its names are this module's too.
from accum_optimizers._keras_private import training as _training  # noqa: E402

LOSS_MODULE_FUNCTIONS = _training.LOSS_MODULE_FUNCTIONS
TRAINER_ATTRIBUTES = _training.TRAINER_ATTRIBUTES
JAX_TRAINER_ATTRIBUTES = _training.JAX_TRAINER_ATTRIBUTES
sublayers = _training.sublayers
LossReduction = _training.LossReduction
loss_module = _training.loss_module
recorded_loss_reductions = _training.recorded_loss_reductions
symbolic_build = _training.symbolic_build
jax_fit_takes_state_from_variables = (
    _training.jax_fit_takes_state_from_variables
)
set_jax_state_to_variables = _training.set_jax_state_to_variables
forget_jax_state = _training.forget_jax_state
GLOBAL_SEED_GENERATOR = _training.GLOBAL_SEED_GENERATOR
global_seed_generator_state = _training.global_seed_generator_state
restore_global_seed_generator = _training.restore_global_seed_generator
is_functional = _training.is_functional
compiled_loss_weights = _training.compiled_loss_weights

# What the package reads from the calling frames (a train step's loss, the
# wrappers taking an optimizer) is in `frames.py`; its names are this
# module's too.
from accum_optimizers._keras_private import frames as _frames  # noqa: E402

jax_train_step_loss = _frames.jax_train_step_loss
tensorflow_train_step_loss = _frames.tensorflow_train_step_loss
wrappers_taking_an_optimizer = _frames.wrappers_taking_an_optimizer
on_tensorflow_tracking = _frames.on_tensorflow_tracking
