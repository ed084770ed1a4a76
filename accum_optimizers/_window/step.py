"""A micro-step's inputs: what arrived beside the call's arguments
(`_inputs`), the weight and the loss checked, and the gradients laid out
over every variable, all before any state changes."""

import contextlib

import keras
from keras import ops

from accum_optimizers import _backend
from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers._validation import concrete_value
from accum_optimizers._validation import validate_gradient
from accum_optimizers._validation import validate_loss
from accum_optimizers._validation import validate_weighable
from accum_optimizers._validation import validate_weight
from accum_optimizers._window.transition import MicroBatch

PARTLY_WRITTEN = (
    "accum_optimizers: this error was raised after the micro-step had begun "
    "to write the optimizer's state (the window's counters and sums, and "
    "maybe part of the parent's update): the optimizer and the model are "
    "partly updated and cannot continue exactly. Restore them from a "
    "checkpoint."
)


def note_loss(optimizer, loss):
    """Keeps `loss`, the micro-batch's (`scale_loss` receives it), for
    `optimizer`'s next `apply` where it keeps a window."""
    if not optimizer._has_window:
        return
    kept = _backend.kept_loss(loss)
    if kept is not None:
        _inputs.put_loss(optimizer, kept)


def weighed_loss(optimizer, loss):
    """`loss` multiplied by the weight handed over for `optimizer`'s next
    `apply` (once), where it keeps a window."""
    handoff = _inputs.handoff_of(optimizer)
    if handoff is None or handoff.loss_scaled or not optimizer._has_window:
        return loss
    handoff.loss_scaled = True
    return ops.multiply(loss, ops.cast(handoff.weight, loss.dtype))


def checked_inputs(optimizer, pending, weight, loss):
    """`(micro_batch, context)`: the call's inputs besides its gradients
    (its arguments, else what `pending`, an `_inputs.Pending`, holds),
    checked, as a `MicroBatch`; and the context in which its state changes
    run (a graph's check of a traced weight)."""
    has_window = optimizer._has_window
    if loss is None:
        loss = pending.loss
    if loss is None and has_window:
        loss = _backend.train_step_loss()
    loss = validate_loss(loss)
    handoff = pending.handoff
    scaled, check, valid, refused = False, True, None, None
    checked = contextlib.nullcontext()
    if weight is None and handoff is not None:
        weight = handoff.weight
        scaled, check = handoff.loss_scaled, handoff.check
        if handoff.checked is not None:
            checked = handoff.checked()
        if handoff.may_be_invalid:
            valid = ops.isfinite(ops.cast(weight, "float32"))
            refused = handoff.refused
    if weight is not None and has_window:
        validate_weighable(optimizer.accumulator_dtype)
    if weight is not None:
        # Windows count samples from now on: a Python fact, known when a
        # compiled step is traced.
        optimizer._counts_weights = True
    if weight is not None and check:
        weight, checked = _checked_weight(optimizer, weight)
    micro_batch = MicroBatch(
        weight, scaled, loss, valid, pending.finite, refused
    )
    return micro_batch, checked


def _checked_weight(optimizer, weight):
    """`(weight, context)`: `weight` as a Python float (concrete) or a
    float32 tensor (traced), refused unless a finite scalar > 0, and the
    context in which the call's state changes run: a traced weight is
    checked at run time by the backend, before them."""
    value = concrete_value(weight)
    if value is not None:
        zero_allowed = _backend.zero_weight_allowed()
        return validate_weight(value, weight, zero_allowed), (
            contextlib.nullcontext()
        )
    weight = ops.convert_to_tensor(weight)
    if len(weight.shape) != 0:
        raise ValueError(
            "`weight` must be a scalar. Received: weight with shape "
            f"{tuple(weight.shape)}"
        )
    backend = optimizer._window_backend
    return backend.check_weight(ops.cast(weight, "float32"))


def laid_out(optimizer, grads, trainable_variables):
    """`grads` checked and laid out over every built variable (`None` for
    a variable not passed); everything that can make the call fail is
    checked here, before any state changes."""
    if trainable_variables is None:
        if not optimizer.built:
            raise ValueError(
                "When passing `grads` without `variables`, the optimizer "
                "must already be built. Call "
                "`optimizer.build(trainable_variables)` first."
            )
        variables = _keras_private.trainable_variables(optimizer)
    else:
        variables = list(trainable_variables)
    if len(grads) != len(variables):
        raise ValueError(
            f"Received {len(grads)} gradients for {len(variables)} "
            "variables; pass one gradient (or `None`) per variable."
        )
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
    _keras_private.check_variables_are_known(optimizer, variables)
    built = _keras_private.trainable_variables(optimizer)
    grads_of_every_variable = [None] * len(built)
    for grad, variable in zip(grads, variables):
        if grad is not None:
            validate_gradient(grad, variable)
            index = _keras_private.variable_index(optimizer, variable)
            grads_of_every_variable[index] = grad
    if all(grad is None for grad in grads_of_every_variable):
        raise ValueError("No gradients provided for any variable.")
    return grads_of_every_variable


@contextlib.contextmanager
def carrying_partial_writes_note():
    """Context in which an error that replaced one noted `PARTLY_WRITTEN`
    (Keras' operations raise a new error of the same type, naming their
    arguments, without the notes) is noted again."""
    try:
        yield
    except Exception as error:
        replaced = error.__context__
        while replaced is not None:
            if PARTLY_WRITTEN in getattr(replaced, "__notes__", ()):
                if PARTLY_WRITTEN not in getattr(error, "__notes__", ()):
                    error.add_note(PARTLY_WRITTEN)
                break
            replaced = replaced.__context__
        raise


@contextlib.contextmanager
def noting_partial_writes(optimizer):
    """Context in which an error says that the optimizer is partly
    written, where a micro-step's writes land as it runs: eagerly, outside
    a `StatelessScope` (an error while a graph is traced, or inside a
    stateless step, wrote nothing)."""
    try:
        yield
    except Exception as error:
        writes_directly = (
            concrete_value(optimizer._window.micro_steps.value) is not None
            and not _keras_private.in_stateless_scope()
        )
        if writes_directly:
            error.add_note(PARTLY_WRITTEN)
        raise
