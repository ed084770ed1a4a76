"""Keras' optimizer wrappers around accumulating optimizers.

Importing the package changes nothing in Keras. A wrapper instance that
meets an accumulating optimizer (Keras' wrappers set the inner optimizers'
`loss_scale_factor` as they take them: `LossScaleOptimizer()`, which
`compile` adds under `mixed_float16`; `MultiOptimizer()` with an
`OptimizerMap`, or its `build` with a function) gets, from `cooperate`,
methods of its own, set on that instance only, around its class' methods:

`keras.optimizers.LossScaleOptimizer` (which `compile` adds under the
`mixed_float16` policy):

- `apply` and `stateless_apply` take `weight=` and `loss=` around an
  accumulating optimizer and hand them to its next `apply` (`_inputs`),
  and keep the note of an error raised after its state began to change
  (Keras' `ops.cond` raises a new error in its place, without notes);
- `scale_loss` passes `fit`'s loss on to it, or to those of a
  `MultiOptimizer` it wraps (`window_loss`);
- a weights-only resume keeps the saved loss scale (around an
  accumulating optimizer or a `MultiOptimizer`): `model.load_weights`
  finds the wrapper unbuilt and Keras skips its state (the dynamic loss
  scale, its step counter) with a warning only, while the inner optimizer
  restores its own when built, so training would resume with the initial
  scale; the saved state is kept instead and restored when it builds.

`keras.optimizers.MultiOptimizer` (where the installed Keras has one):

- `apply` checks every inner optimizer's call (gradients, weight, loss)
  before any inner optimizer writes: one that raised after another had
  closed its window would leave their windows a micro-batch apart;
- `scale_loss` passes `fit`'s loss on to the inner accumulating optimizers
  (one mapped by a function holds it until `apply` builds it and names
  them; `weigh_micro_batches` builds it before handing the weight over);
- `apply` checks every gradient for finiteness once and hands the result to
  the inner optimizers with `skip_nonfinite=True`, so that they skip the
  same micro-batches: each checking its own variables only would let one
  skip a micro-batch another adds, and their windows drift apart;
- `apply` refuses an inner optimizer with an AdaScale learning rate or a
  scaling rule's beside others: AdaScale's gain and a rule's clock are
  the whole model's;
- `apply` warns, once, of inner optimizers whose windows `by_noise_scale`
  sizes, each from its own variables, or whose windows differ (another
  `accum_iters`, or an optimizer that does not accumulate): no big batch
  updates a model that way.

Every other instance, and every class, is as Keras wrote it. These methods
hand the accumulating optimizers their values through `_inputs`.
"""

import types
import weakref

import keras
import numpy as np

from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers._autograph import unconverted
from accum_optimizers._backend import outside_compiled_code
from accum_optimizers._inner import accumulating_optimizers
from accum_optimizers._multi_wrapper import agreeing_apply
from accum_optimizers._multi_wrapper import is_accumulating_class
from accum_optimizers._multi_wrapper import note_loss_through
from accum_optimizers._multi_wrapper import noting_multi_scale_loss
from accum_optimizers._multi_wrapper import refuse_at_build
from accum_optimizers._window.restore import pending_restore
from accum_optimizers._window.step import carrying_partial_writes_note

# The saved state (loss scale, step counter, then the inner optimizer's) of
# each unbuilt `LossScaleOptimizer`, kept for its `build`; held weakly.
_PENDING_SCALE_STATE: weakref.WeakKeyDictionary[object, object] = (
    weakref.WeakKeyDictionary()
)


def cooperate(wrapper):
    """Gives the Keras wrapper instance `wrapper` (a `LossScaleOptimizer` or
    `MultiOptimizer`) the cooperation the module's docstring lists: its own
    methods, set on the instance, around its class' (left as Keras wrote
    it). Once per instance; called when it meets an accumulating optimizer
    (`GradientAccumulation.loss_scale_factor`)."""
    if wrapper.__dict__.get("_accum_cooperating"):
        return
    cls = type(wrapper)
    if isinstance(wrapper, keras.optimizers.LossScaleOptimizer):
        methods = {
            "apply": _weighing(cls.apply),
            "stateless_apply": _weighing(cls.stateless_apply),
            "scale_loss": _noting_scale_loss(cls.scale_loss),
            "load_own_variables": _deferring_load(cls.load_own_variables),
            "build": _restoring_build(cls.build),
        }
    else:
        methods = {
            "apply": agreeing_apply(cls.apply),
            "scale_loss": noting_multi_scale_loss(cls.scale_loss),
        }
    # Into `__dict__`: an attribute of the instance, not one Keras' tracking
    # (`__setattr__`) looks at.
    for name, method in methods.items():
        wrapper.__dict__[name] = types.MethodType(unconverted(method), wrapper)
    wrapper.__dict__["_accum_cooperating"] = True
    if not isinstance(wrapper, keras.optimizers.LossScaleOptimizer):
        _keras_private.on_tensorflow_tracking(wrapper, meet_wrappers)


def meet_wrappers(building=False):
    """`cooperate` with the Keras wrappers taking an optimizer in the
    calling frames (`wrappers_taking_an_optimizer`); `building`: from the
    optimizer's `build`, where a `MultiOptimizer` has named every one."""
    for wrapper in _keras_private.wrappers_taking_an_optimizer():
        cooperate(wrapper)
        if building and _keras_private.is_multi_optimizer(wrapper):
            refuse_at_build(wrapper)


def cooperate_through(optimizer):
    """`cooperate` with each wrapper `optimizer` is or holds (a
    `LossScaleOptimizer`, a `MultiOptimizer`), outermost first."""
    while isinstance(optimizer, _keras_private.wrapper_optimizer_classes()):
        cooperate(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)


def _weighing(method):
    """`LossScaleOptimizer.apply` (or `stateless_apply`) that takes `weight`
    and `loss` for an accumulating inner optimizer."""

    def weighed(self, *args, weight=None, loss=None, **kwargs):
        with carrying_partial_writes_note():
            if weight is None and loss is None:
                return method(self, *args, **kwargs)
            return weighed_call(self, args, kwargs, weight, loss)

    def weighed_call(self, args, kwargs, weight, loss):
        inner = self.inner_optimizer
        if not is_accumulating_class(inner):
            raise TypeError(
                f"LossScaleOptimizer.{method.__name__}() takes `weight` "
                "and `loss` only around an accumulating optimizer. "
                f"Received: inner_optimizer={inner!r}"
            )
        if weight is not None:
            _inputs.hand_over(inner, _inputs.Handoff(weight, check=True))
        if loss is not None:
            _inputs.put_loss(inner, loss)
        try:
            return method(self, *args, **kwargs)
        finally:
            # Left over when the step was skipped (gradients not
            # finite) or raised before the inner optimizer's `apply`.
            _inputs.discard(inner)

    weighed.__name__ = method.__name__
    weighed.__doc__ = method.__doc__
    return weighed


def _deferring_load(load_own_variables):
    """`load_own_variables` that keeps an unbuilt loss scale's saved state
    for `build` (`_restoring_build`) around an accumulating optimizer."""

    def deferring_load_own_variables(self, store):
        if self.built or not accumulating_optimizers(self.inner_optimizer):
            return load_own_variables(self, store)
        values = [np.array(store[str(i)]) for i in range(len(store.keys()))]
        _PENDING_SCALE_STATE[self] = tuple(values)

    return deferring_load_own_variables


def _restoring_build(build):
    """`build` that restores the loss scale's state `_deferring_load`
    kept."""

    def restoring_build(self, var_list):
        pending = _PENDING_SCALE_STATE.pop(self, None)
        # Before `build`, where the inner optimizers take theirs.
        saved = None if pending is None else _saved_own_state(self, pending)
        build(self, var_list)
        if saved is None:
            return  # Saved untrained: a fresh loss scale is the saved one.
        inner_ids = {id(v) for v in self.inner_optimizer.variables}
        own = [v for v in self.variables if id(v) not in inner_ids]
        if len(saved) != len(own) or any(
            np.shape(value) != tuple(variable.shape)
            for value, variable in zip(saved, own)
        ):
            raise ValueError(
                f"Cannot restore the state of optimizer '{self.name}' "
                "(LossScaleOptimizer): the checkpoint holds "
                f"{len(saved)} variables of its own (loss scale and step "
                f"counter), this one has {len(own)}."
            )
        # TensorFlow builds it while tracing the first train step: assign
        # once, now, not in the traced step.
        with outside_compiled_code():
            for variable, value in zip(own, saved):
                variable.assign(value)

    return restoring_build


def _saved_own_state(optimizer, pending):
    """The loss scale's own part of its saved state `pending` (the
    constructor's variables, then `build`'s step counter and dynamic
    scale), where it was saved trained; else `None`. The inner
    optimizers' saved states (kept for their `build`) tell both."""
    inner = optimizer.inner_optimizer
    if is_accumulating_class(inner):
        saved_inner = pending_restore(inner)
        if saved_inner is None:
            return None
        return pending[: len(pending) - len(saved_inner)]
    # A `MultiOptimizer`: its variables follow the loss scale's own.
    if all(pending_restore(o) is None for o in accumulating_optimizers(inner)):
        return None
    return pending[: len(_keras_private.own_variables(optimizer)) + 2]


def _noting_scale_loss(scale_loss):
    """`scale_loss` that notes the loss for an accumulating inner
    optimizer's `window_loss`."""

    def noting_scale_loss(self, loss):
        # `fit` hands the loss to the optimizer it compiled with: the
        # inner optimizers' `window_loss` needs it too (Keras' own does
        # not call the inner optimizer's `scale_loss`).
        note_loss_through(self.inner_optimizer, loss)
        saved = _saved_scale(self)
        if saved is not None:
            # Unbuilt, Keras scales by `initial_scale`; but `apply` builds
            # it, restores the saved scale and unscales by that.
            return keras.ops.multiply(loss, saved)
        return scale_loss(self, loss)

    return noting_scale_loss


def _saved_scale(optimizer):
    """The loss scale a `LossScaleOptimizer` loaded before it was built
    will restore in `build` (`_restoring_build`), or `None`."""
    if optimizer.built:
        return None
    pending = _PENDING_SCALE_STATE.get(optimizer)
    saved = None if pending is None else _saved_own_state(optimizer, pending)
    if saved is None:
        return None
    # `build` adds `step_counter`, then `dynamic_scale`, after the
    # variables the constructor made.
    index = len(_keras_private.own_variables(optimizer)) + 1
    if len(saved) != index + 1 or np.shape(saved[index]) != ():
        return None  # `build` refuses the state, naming why
    return float(saved[index])
