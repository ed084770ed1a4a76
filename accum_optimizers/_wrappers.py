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
- `apply` refuses an inner optimizer with an AdaScale learning rate
  beside others: AdaScale's gain is the whole model's;
- `apply` warns, once, of inner optimizers whose windows `by_noise_scale`
  sizes, each from its own variables, or whose windows differ (another
  `accum_iters`, or an optimizer that does not accumulate): no big batch
  updates a model that way.

Every other instance, and every class, is as Keras wrote it. These methods
hand the accumulating optimizers their values through `_inputs`.
"""

import types
import warnings
import weakref

import keras
import numpy as np

from accum_optimizers import _backend
from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers._accumulation import GradientAccumulation
from accum_optimizers._autograph import unconverted
from accum_optimizers._backend import outside_compiled_code
from accum_optimizers._inner import accumulating_optimizers
from accum_optimizers._inner import count_updates_in_multi_optimizer
from accum_optimizers._inner import shown_window
from accum_optimizers._inner import unnamed_multi_optimizer
from accum_optimizers._inner import window_of
from accum_optimizers._noise_schedule import keyed_on_noise_scale
from accum_optimizers._validation import concrete_value
from accum_optimizers._validation import validate_gradient
from accum_optimizers._validation import validate_loss
from accum_optimizers._validation import validate_weighable
from accum_optimizers._validation import validate_weight
from accum_optimizers._window import adascale
from accum_optimizers._window.restore import pending_restore
from accum_optimizers._window.step import carrying_partial_writes_note
from accum_optimizers._window.step import laid_out
from accum_optimizers._window.step import note_loss

# The `MultiOptimizer`s `_warn_of_windows_apart` warned of; held weakly.
_WARNED_WINDOWS_APART = weakref.WeakSet()

# The saved state (loss scale, step counter, then the inner optimizer's) of
# each unbuilt `LossScaleOptimizer`, kept for its `build`; held weakly.
_PENDING_SCALE_STATE = weakref.WeakKeyDictionary()


def is_accumulating_class(optimizer):
    """Whether `optimizer` is of an accumulating class (any `accum_iters`)."""
    return isinstance(optimizer, GradientAccumulation)


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
            "apply": _agreeing_apply(cls.apply),
            "scale_loss": _noting_multi_scale_loss(cls.scale_loss),
        }
    # Into `__dict__`: an attribute of the instance, not one Keras' tracking
    # (`__setattr__`) looks at.
    for name, method in methods.items():
        wrapper.__dict__[name] = types.MethodType(unconverted(method), wrapper)
    wrapper.__dict__["_accum_cooperating"] = True
    if not isinstance(wrapper, keras.optimizers.LossScaleOptimizer):
        _keras_private.on_tensorflow_tracking(wrapper, meet_wrappers)


def meet_wrappers(optimizer=None):
    """`cooperate` with the Keras wrappers taking an optimizer in the
    calling frames (`wrappers_taking_an_optimizer`)."""
    for wrapper in _keras_private.wrappers_taking_an_optimizer():
        cooperate(wrapper)


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
    return pending[: len(optimizer._variables) + 2]


def _noting_scale_loss(scale_loss):
    """`scale_loss` that notes the loss for an accumulating inner
    optimizer's `window_loss`."""

    def noting_scale_loss(self, loss):
        # `fit` hands the loss to the optimizer it compiled with: the
        # inner optimizers' `window_loss` needs it too (Keras' own does
        # not call the inner optimizer's `scale_loss`).
        _note_loss_through(self.inner_optimizer, loss)
        saved = _saved_scale(self)
        if saved is not None:
            # Unbuilt, Keras scales by `initial_scale`; but `apply` builds
            # it, restores the saved scale and unscales by that.
            return keras.ops.multiply(loss, saved)
        return scale_loss(self, loss)

    return noting_scale_loss


def _note_loss_through(optimizer, loss):
    """Notes `loss` for the accumulating optimizers `optimizer` applies
    through (`note_loss`). A `MultiOptimizer` that has not named them yet
    (`unnamed_multi_optimizer`) holds it until its `apply` builds it."""
    multi = unnamed_multi_optimizer(optimizer)
    if multi is None:
        for inner in accumulating_optimizers(optimizer):
            note_loss(inner, loss)
        return
    kept = _backend.kept_loss(loss)
    if kept is not None:
        _inputs.put_loss(multi, kept)


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
    index = len(optimizer._variables) + 1
    if len(saved) != index + 1 or np.shape(saved[index]) != ():
        return None  # `build` refuses the state, naming why
    return float(saved[index])


def _accumulating_with_window(multi_optimizer):
    return [
        optimizer
        for optimizer in multi_optimizer.optimizers
        if is_accumulating_class(optimizer) and optimizer._has_window
    ]


def _noting_multi_scale_loss(scale_loss):
    """`MultiOptimizer.scale_loss` that notes the loss for its inner
    accumulating optimizers' `window_loss`."""

    def noting_scale_loss(self, loss):
        _note_loss_through(self, loss)
        return scale_loss(self, loss)

    return noting_scale_loss


def _agreeing_apply(apply):
    """`MultiOptimizer.apply` whose inner optimizers agree: see the module's
    docstring."""

    def agreeing_apply(self, grads, trainable_variables=None):
        # The loss `scale_loss` held while the optimizers were unnamed.
        held_loss = _inputs.take(self).loss
        unnamed = unnamed_multi_optimizer(self) is not None
        if unnamed and len(grads) and trainable_variables is not None:
            self.build(trainable_variables)  # as Keras' `apply` does first
        adascale.check_not_in_multi_optimizer(self)
        inner = _accumulating_with_window(self)
        if held_loss is not None:
            for optimizer in inner:
                _inputs.put_loss(optimizer, held_loss)
        _check_inner_calls(self, grads, trainable_variables)
        _warn_of_windows_apart(self, inner)
        skipping = [o for o in inner if o.skip_nonfinite]
        if skipping and len(grads):
            finite = skipping[0]._window_backend.read_gradients(
                grads, squares=False, finite=True
            )[1]
            for optimizer in skipping:
                _inputs.put_finite(optimizer, finite)
        try:
            result = apply(self, grads, trainable_variables)
        finally:
            for optimizer in skipping:
                _inputs.discard(optimizer)
        # Keras counts micro-batches; inner optimizers that update together
        # count updates, as the big batch's `MultiOptimizer` does.
        count_updates_in_multi_optimizer(self)
        return result

    agreeing_apply.__doc__ = apply.__doc__
    return agreeing_apply


def _warn_of_windows_apart(multi, accumulating):
    """Warns once per `MultiOptimizer` whose optimizers may close their
    windows at different micro-batches, where the big batch updates the
    whole model at once: several `accumulating` ones, one of which sizes
    its windows by `by_noise_scale` (each measures the noise scale of its
    own variables), or optimizers whose windows differ (`window_of`)."""
    if multi in _WARNED_WINDOWS_APART or not accumulating:
        return
    _WARNED_WINDOWS_APART.add(multi)
    keyed = [
        o.name for o in accumulating if keyed_on_noise_scale(o.accum_iters)
    ]
    if keyed and len(accumulating) > 1:
        warnings.warn(
            f"MultiOptimizer '{multi.name}': its optimizers {keyed} size "
            "their windows by `by_noise_scale`, each from the noise scale "
            "of its own variables, so their windows may close at "
            "different micro-batches (no big batch does that). Give them "
            "fixed windows (an int, a dict or a schedule keyed on "
            "updates or samples), or use one accumulating optimizer.",
            stacklevel=3,
        )
        return
    windows = [(o, window_of(o)) for o in multi.optimizers]
    if all(window == windows[0][1] for _, window in windows):
        return
    listed = ", ".join(
        f"'{o.name}' ({type(o).__name__}): "
        + (
            "every micro-batch"
            if window == 1
            else f"accum_iters={shown_window(window)}"
        )
        for o, window in windows
    )
    warnings.warn(
        f"MultiOptimizer '{multi.name}': its optimizers update at "
        f"different micro-batches ({listed}), so no big batch trains the "
        "model as it does: each updates its variables with the mean over "
        "its own window. For the big batch, give every optimizer in it "
        "the same `accum_iters` (an optimizer that does not accumulate "
        "updates on every micro-batch: use its accumulating class, such "
        "as `AdamAccumulate` for `Adam`).",
        stacklevel=3,
    )


def _check_inner_calls(multi, grads, trainable_variables):
    """Raises where an inner optimizer's `apply` would in
    `multi.apply(grads, trainable_variables)`, before any of them writes.

    Keras' own checks (the count of gradients, an unbuilt `multi` without
    variables, a variable it was not built with) raise before any inner
    optimizer is called: they are left to it.
    """
    if not any(is_accumulating_class(o) for o in multi.optimizers) or not len(
        grads
    ):
        return
    if trainable_variables is None:
        if not multi.built:
            return
        trainable_variables = multi._trainable_variables
    if not multi.built:
        multi.build(trainable_variables)  # as `apply` does first
    if len(grads) != len(trainable_variables):
        return
    groups = _keras_private.multi_optimizer_groups(
        multi, grads, trainable_variables
    )
    for inner, inner_grads, inner_variables in groups:
        _check_call(inner, inner_grads, inner_variables)


def _check_call(optimizer, grads, variables):
    """Raises where `optimizer.apply(grads, variables)` would, writing
    nothing and leaving what `_inputs` holds for the call in place."""
    if not (is_accumulating_class(optimizer) and optimizer._has_window):
        # The parent's `apply`: its gradients are cast to the variables.
        for grad, variable in zip(grads, variables):
            if grad is not None:
                validate_gradient(grad, variable)
        return
    pending = _inputs.peek(optimizer)
    validate_loss(pending.loss)
    handoff = pending.handoff
    if handoff is not None:
        validate_weighable(optimizer.accumulator_dtype)
        value = concrete_value(handoff.weight) if handoff.check else None
        if value is not None:
            zero_allowed = _backend.zero_weight_allowed()
            validate_weight(value, handoff.weight, zero_allowed)
    laid_out(optimizer, list(grads), variables)
