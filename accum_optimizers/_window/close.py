"""The window's close: its sums reduced over replicas, their mean, the
window's metrics, the parent's update and the samples count; `flush`, which
closes a partial window; and what the end of `fit` checks.

The close runs once per window, inside the backend's branch of the
micro-step that fills it (or eagerly, from `flush`): the update math, the
all-reduce of `tf.distribute` and `sync_windows`, clipping, weight decay and
EMA run there and nowhere else.
"""

import warnings

import numpy as np
from keras import backend
from keras import ops

from accum_optimizers import _backend
from accum_optimizers import _keras_private
from accum_optimizers._validation import concrete_value
from accum_optimizers._window import adascale
from accum_optimizers._window import counts
from accum_optimizers._window import noise


def close_window(optimizer, present=None):
    """Applies the window's mean gradient.

    Every variable that had gradient in any micro-step of the window, on
    any replica or rank, is updated with the window's mean (the micro-steps
    without its gradient count zero), as the big batch updates it; one
    with none in the whole window is left alone, as the parent leaves it,
    and so is one not trainable now.

    Args:
        optimizer: the accumulating optimizer.
        present: the indices of the variables with a gradient in the call
            that closes the window, known to be updated while compiled code
            is traced, where the seen-mask is not known yet; `None` from
            `flush`, which reads the mask.
    """
    window, backend = optimizer._window, optimizer._window_backend
    variables = _keras_private.trainable_variables(optimizer)
    summed = [
        i
        for i, variable in enumerate(variables)
        if not _keras_private.overwrites_with_gradient(optimizer, variable)
    ]
    # Read the counts here, inside the branch: under TensorFlow's XLA
    # loop, a tensor captured from outside costs every micro-step.
    total_weight = window.total_weight.value
    extras = [
        window.loss_sum.value,
        ops.cast(window.seen.value, "float32"),
        *noise.window_sums(window),
    ]
    sums, extras, total_weight = backend.reduce_window(
        [window.sums[i].value for i in summed], extras, total_weight
    )
    loss_sum, seen, noise_sums = extras[0], extras[1], extras[2:]
    known_weight = concrete_value(total_weight)
    if known_weight is not None:
        # Eagerly the scalar math below is Python's: each `keras.ops`
        # call on a tensor is a dispatch or more.
        total_weight = float(known_weight)
    updated, masks = _updated(seen, range(len(variables)), present)
    # The big batch of a model whose layer was frozen mid-window does not
    # reach it either.
    updated = [i for i in updated if variables[i].trainable]
    if not updated:
        return  # A window of frozen variables only: the parent makes none.
    reduced = dict(zip(summed, sums))
    averaged = [i for i in updated if i in reduced]
    sums = [reduced[i] for i in averaged]
    # A window whose micro-batches all weigh 0 (every sample weight or
    # token masked) has zero sums: a zero gradient, as the big batch's
    # `divide_no_nan`.
    if isinstance(total_weight, float):
        divisor = total_weight if total_weight > 0 else 1.0
    else:
        divisor = ops.where(ops.greater(total_weight, 0.0), total_weight, 1.0)
    # The norm from the sums, before the means replace them: read after,
    # XLA keeps every mean beside the sums.
    grad_norm = ops.divide(_global_norm(sums), divisor)
    replicas = _backend.replica_count(optimizer)
    if noise_sums:
        noise.close(optimizer, noise_sums, ops.square(grad_norm), total_weight)
    if adascale.follows(optimizer):
        # AdaScale's gain from the averages this window entered, or a
        # rule's `S`, before the parent's update reads the learning rate.
        adascale.close(optimizer, noise.big_batch(optimizer, total_weight))
    means = backend.mean([window.sums[i] for i in averaged], sums, divisor)
    grads = dict(zip(averaged, means))
    for i in updated:
        if i not in grads:
            # A float8 scale (`overwrite_with_gradient`): the window's
            # maximum. The parent overwrites it before any update step
            # reads a mask, so compiled code selects here: its own value
            # where the window had none of its gradient.
            grads[i] = window.sums[i].value
            mask = masks.pop(i, None)
            if mask is not None:
                grads[i] = ops.where(mask, grads[i], variables[i].value)
    with adascale.applying(optimizer):
        optimizer._apply_window_mean(
            [_cast(grads[i], variables[i].dtype) for i in updated],
            [variables[i] for i in updated],
            masks,
        )
    # After the update, whose learning rate is that of the samples seen
    # before the window. The close divides by the replicas' mean total
    # weight; a weighted window counts each replica's samples: their sum.
    samples = total_weight
    if replicas > 1 and optimizer._counts_weights:
        samples = ops.multiply(total_weight, float(replicas))
    writes = [
        (window.window_grad_norm, grad_norm),
        (window.window_loss, ops.divide(loss_sum, divisor)),
        *counts.add_compensated(
            window.samples_seen, window.samples_seen_error, samples
        ),
    ]
    if adascale.follows(optimizer):
        writes += adascale.advance(optimizer)
    # Between windows the pending weight is 0. Written last: without a
    # write at its end, XLA schedules the close's copies of the sums it
    # only reads beside the update's temporaries (`benchmarks/memory.py`).
    writes.append((window.total_weight, 0.0))
    _backend.assign(writes)


def flush(optimizer):
    """`optimizer.flush()` (see its docstring)."""
    if not optimizer._has_window or not optimizer.built:
        return
    window, backend = optimizer._window, optimizer._window_backend
    pending = int(ops.convert_to_numpy(window.micro_steps.value))
    if pending == 0:
        return
    backend.begin(flushing=True)
    finite = all(
        np.isfinite(ops.convert_to_numpy(total.value)).all()
        for total, variable in zip(
            window.sums, _keras_private.trainable_variables(optimizer)
        )
        if not _keras_private.overwrites_with_gradient(optimizer, variable)
    )
    if not backend.agree(finite):
        warnings.warn(
            f"{type(optimizer).__name__}.flush(): the pending window of "
            f"{pending} micro-batches holds non-finite gradients; it was "
            "discarded and the weights were left unchanged.",
            stacklevel=3,
        )
    else:
        close_window(optimizer)
    window.micro_steps.assign(np.zeros((), "int32"))


def _updated(seen, candidates, present):
    """`(updated, masks)`: the indices of the variables the window
    updates, and `{index: traced bool}` for those of them that compiled
    code updates only where the bool is true.

    Where the closing call has a gradient for every variable of
    `candidates` (all of them), all of them. Where `seen` (the window's
    seen-mask, added over replicas) is known, the variables it marks.
    While compiled code is traced it is not: the closing call's variables
    (`present`) are updated, and every other one under its seen bit.
    """
    if present is not None and set(candidates) <= set(present):
        # No read of the mask (a device sync, eagerly), no branch.
        return list(present), {}
    known = concrete_value(seen)
    if known is not None:
        return [i for i in range(len(known)) if known[i] > 0], {}
    maybe = [i for i in candidates if i not in present]
    masks = {i: ops.greater(seen[i], 0) for i in maybe}
    return sorted(set(present) | set(maybe)), masks


def _cast(value, dtype):
    """`value` in `dtype`, cast only where it is not (eagerly each cast is
    a dispatch)."""
    if backend.standardize_dtype(value.dtype) == dtype:
        return value
    return ops.cast(value, dtype)


def _global_norm(tensors):
    """The float32 norm of `tensors` taken together."""
    return ops.sqrt(ops.sum(_backend.sums_of_squares(tensors)))


def check_end_of_fit(optimizer, flushed):
    """At the end of `fit`: raises for micro-batches compiled code left
    out of their windows for an invalid loss normalizer, and warns of a
    pending window unless something `flushed` it."""
    window = optimizer._window
    _report_refused_weights(optimizer, window)
    if flushed:
        return
    try:
        pending = int(ops.convert_to_numpy(window.micro_steps.value))
    except TypeError:
        # A JAX train step that failed leaves the variables without
        # values; let its own error through.
        return
    if pending:
        warnings.warn(
            f"Training ended with {pending} micro-batches of a window "
            f"pending in {type(optimizer).__name__}: they carry into the "
            "next `fit`, and the weights do not include them yet. To "
            "apply them as a last, smaller update (as the big-batch "
            "run's short last batch), add "
            "`accum_optimizers.FlushAccumulation()` to the callbacks, "
            "or use a sample count that is a multiple of "
            "`batch_size * accum_iters`.",
            stacklevel=3,
        )


def _report_refused_weights(optimizer, window):
    """Raises for micro-batches that compiled code left out of their
    windows because `weigh_micro_batches` refused their loss normalizer
    (it cannot raise there): negative, or not finite without
    `skip_nonfinite` (with it, a non-finite one is a skip)."""
    try:
        refused = int(ops.convert_to_numpy(window.refused.value))
    except TypeError:
        return  # A failed JAX step; its own error goes through.
    reported = optimizer._refused_reported
    if refused > reported:
        optimizer._refused_reported = refused
        raise ValueError(
            f"weigh_micro_batches(model): {refused - reported} "
            "micro-batches had a loss normalizer (the sum of their "
            "sample weights) that is negative or not finite; they were "
            "left out of their windows, and the weights did not move for "
            "them. Negative sample weights are not supported. Received: "
            f"refused_micro_batches={refused}"
        )
