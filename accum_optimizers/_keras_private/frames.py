"""What the package reads from the calling frames, where Keras hands it
nothing: a train step's loss, and the Keras optimizer wrappers taking an
optimizer. Listed in `_keras_private/__init__.py`'s docstring; exercised by
`tests/test_keras_private.py`."""

import inspect
import sys
import types

import keras


def jax_train_step_loss():
    """The unscaled loss of the micro-batch whose gradients Keras' JAX
    `train_step` is applying, or `None` when the caller is not that train
    step.

    Keras' JAX trainer computes the loss inside `jax.value_and_grad` and
    hands the optimizer only the gradients: the loss is the train step's
    local `unscaled_loss`, read here from the calling frames.
    """
    from keras.src.backend.jax import trainer

    # `JAXTrainer` through Keras 3.15, `Trainer` in keras-nightly 3.16.
    trainer_class = getattr(trainer, "JAXTrainer", None) or trainer.Trainer
    found = _train_step_locals(trainer_class.train_step.__code__)
    return None if found is None else found.get("unscaled_loss")


def tensorflow_train_step_loss():
    """`(model, loss)` of Keras' TensorFlow `train_step` applying the
    gradients (its `self` and `loss`, the loss its model's optimizer's
    `scale_loss` returned), or `None` when the caller is not that step."""
    from keras.src.backend.tensorflow import trainer

    found = _train_step_locals(trainer.TensorFlowTrainer.train_step.__code__)
    if found is None or "loss" not in found:
        return None
    return found["self"], found["loss"]


def _train_step_locals(train_step):
    """The locals of the calling frame running the code `train_step`, or
    `None`."""
    frame = sys._getframe(1)
    for _ in range(_TRAIN_STEP_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code is train_step:
            return frame.f_locals
    return None


def wrappers_taking_an_optimizer():
    """The Keras optimizer wrappers in the calling frames that are taking an
    inner optimizer, outermost last: the frames of the wrapper methods that
    set its `loss_scale_factor` (`LossScaleOptimizer.__init__` and `build`;
    `MultiOptimizer.__init__`, `build` and its `loss_scale_factor`
    setter), read from the caller's setter of `loss_scale_factor`."""
    codes = _wrapper_codes()
    wrappers = []
    frame = sys._getframe(1)
    for _ in range(_WRAPPER_DEPTH):
        frame = frame.f_back
        if frame is None:
            break
        if frame.f_code in codes:
            wrapper = frame.f_locals.get("self")
            if wrapper is not None and wrapper not in wrappers:
                wrappers.append(wrapper)
    return wrappers


def _wrapper_codes():
    """The code objects of the wrapper methods `wrappers_taking_an_optimizer`
    looks for."""
    loss_scale = keras.optimizers.LossScaleOptimizer
    methods = [loss_scale.__init__, loss_scale.build]
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is not None:
        methods += [multi.__init__, multi.build, multi.loss_scale_factor.fset]
    # `build` of `LossScaleOptimizer` is wrapped by Keras' tracking
    # decorator: its code is the wrapped function's.
    return {inspect.unwrap(method).__code__ for method in methods}


def on_tensorflow_tracking(obj, meet):
    """On TensorFlow, has `meet(obj)` run wherever another object starts
    tracking `obj` (elsewhere, nothing).

    TensorFlow's `Trackable._track_trackable` calls the tracked object's
    `_maybe_initialize_trackable()`: here a method of that instance only,
    which calls its class' first. `LossScaleOptimizer.__init__` tracks a
    `MultiOptimizer` so, and then sets its `loss_scale_factor`, which
    TensorFlow's `__setattr__` skips where the value is unchanged.
    """
    if keras.backend.backend() != "tensorflow":
        return
    obj.__dict__["_maybe_initialize_trackable"] = types.MethodType(
        _initializing(meet), obj
    )


def _initializing(meet):
    def initialize(self):
        type(self)._maybe_initialize_trackable(self)
        meet(self)

    return initialize


# From a `loss_scale_factor` setter up through Keras' `__setattr__` (and
# TensorFlow's tracking) to a `LossScaleOptimizer` around a
# `MultiOptimizer` setting it.
_WRAPPER_DEPTH = 16


# The optimizer's `apply` runs some calls below `train_step`
# (`stateless_apply`, a `LossScaleOptimizer` whose `lax.cond` adds JAX's
# own tracing frames, a `MultiOptimizer`); the walk runs once per trace
# (on TensorFlow, only where no loss reached the optimizer).
_TRAIN_STEP_DEPTH = 80
