"""A `MultiOptimizer`'s cooperation with its accumulating optimizers: its
`apply` and `scale_loss` as `_wrappers.cooperate` sets them on an instance
that met one (see `_wrappers.py`'s docstring for what each does)."""

import warnings
import weakref

from accum_optimizers import _backend
from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers._accumulation import GradientAccumulation
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
from accum_optimizers._window.step import laid_out
from accum_optimizers._window.step import note_loss

# The `MultiOptimizer`s `_warn_of_windows_apart` warned of; held weakly.
_WARNED_WINDOWS_APART: weakref.WeakSet[object] = weakref.WeakSet()


def is_accumulating_class(optimizer):
    """Whether `optimizer` is of an accumulating class (any `accum_iters`)."""
    return isinstance(optimizer, GradientAccumulation)


def note_loss_through(optimizer, loss):
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


def _accumulating_with_window(multi_optimizer):
    return [
        optimizer
        for optimizer in multi_optimizer.optimizers
        if is_accumulating_class(optimizer) and optimizer._has_window
    ]


def noting_multi_scale_loss(scale_loss):
    """`MultiOptimizer.scale_loss` that notes the loss for its inner
    accumulating optimizers' `window_loss`."""

    def noting_scale_loss(self, loss):
        note_loss_through(self, loss)
        return scale_loss(self, loss)

    return noting_scale_loss


def agreeing_apply(apply):
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


def refuse_at_build(multi):
    """The refusals of `agreeing_apply` that need no call's arguments, run
    where `multi` builds its optimizers too: mapped by a function, it meets
    them only there, inside its first `apply`, which runs as Keras wrote
    it."""
    adascale.check_not_in_multi_optimizer(multi)


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
        trainable_variables = _keras_private.trainable_variables(multi)
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
