"""One micro-step as a value.

`micro_step` computes, in `keras.ops`, every value the window holds after
one micro-batch, from its current values and the micro-batch's checked
inputs, and whether the micro-batch opens or closes the window; nothing is
written until the backend commits the `Step` it returns. Eagerly the
window's position is read once and the selects below are Python's. Each
feature is a term of this one computation:

    the window      micro_steps + 1; opens at 1; closes at the window
                    size, where it goes back to 0
    weights         total_weight + w; the gradients enter as w * g, or
                    arrive so (`scaled`)
    skip            `enters`: gradients finite and weight valid on every
                    replica; where false nothing moves but skipped + 1,
                    or refused + 1 for a refused loss normalizer
    window metrics  loss_sum + w * loss; `seen` marks the variables with
                    a gradient
    noise scale     noise sums + (R^2 |g|^2 / w^2, 1 / w, 1), for a
                    micro-batch of weight > 0

The window's first micro-step overwrites the values that belong to the
pending window instead of adding to them; what is counted at the close
(the mean, the samples, the estimates) is in `close.py` and `noise.py`.
"""

import dataclasses

import numpy as np
from keras import ops

from accum_optimizers._finite import masked
from accum_optimizers._validation import concrete_value


@dataclasses.dataclass
class MicroBatch:
    """A micro-step's checked inputs besides its gradients.

    Args:
        weight: `None` (counts 1), a Python float, or a float32 scalar.
        scaled: whether the gradients arrive multiplied by `weight` (see
            `scale_loss`).
        loss: the micro-batch's loss (a float32 scalar), or `None`.
        valid: `None`, or whether a weight that compiled code could not
            refuse is valid (it is NaN where not).
        finite: `None`, or whether a wrapper found every gradient finite
            (`MultiOptimizer`).
        refused: `None`, or whether compiled code refused its loss
            normalizer (`valid` is then false); agreed over replicas by
            `micro_step`'s caller.
    """

    weight: object = None
    scaled: bool = False
    loss: object = None
    valid: object = None
    finite: object = None
    refused: object = None


@dataclasses.dataclass
class Step:
    """What one micro-step computed, to commit.

    Args:
        enters: `None` where the micro-batch enters its window, else
            whether it does (a bool, or a traced scalar bool).
        opens: whether it is the window's first micro-step.
        closes: whether it is the window's last.
        weight: what its gradients are multiplied by into the sums (`None`
            for 1, or where they arrive `scaled`).
        scaled: whether its gradients arrive multiplied by its weight.
        present: the indices of the variables it has a gradient for.
        micro_steps, micro_batches, seen, total_weight, loss_sum: the
            window's counters after it.
        skipped: the skip count after it, or `None` where unchanged.
        refused: the count of refused normalizers after it, or `None`
            where unchanged.
        noise_sums: the noise scale's three sums after it, or `None`.
    """

    enters: object
    opens: object
    closes: object
    weight: object
    scaled: bool
    present: list
    micro_steps: object
    micro_batches: object
    seen: object
    total_weight: object
    loss_sum: object
    skipped: object = None
    refused: object = None
    noise_sums: tuple | None = None


def enters(finite, valid):
    """Whether a micro-batch enters its window, on this replica: its
    gradients are `finite` (`None` where not checked) and its weight
    `valid` (`None` where it cannot be refused); `None` where nothing
    leaves it out."""
    if finite is None or valid is None:
        return valid if finite is None else finite
    return ops.logical_and(finite, valid)


def micro_step(
    window, grads, micro_batch, agreed, window_size, squares, replicas
):
    """The `Step` of one micro-batch.

    Args:
        window: the optimizer's `Window`, read, not written.
        grads: one gradient (or `None`) per variable.
        micro_batch: its `MicroBatch`.
        agreed: whether it enters, agreed over replicas (`enters`), or
            `None`.
        window_size: the size of the window it belongs to (an int or an
            int32 scalar).
        squares: its gradients' sums of squares (a float32 vector) where
            the noise scale is measured, else `None`.
        replicas: the number of replicas its gradients are divided by.
    """
    known = None if agreed is None else concrete_value(agreed)
    if known is not None:
        agreed = None if bool(known) else False
    if agreed is False:
        return _left_out(window, micro_batch)
    count = 1 if agreed is None else ops.cast(agreed, "int32")
    before = _known_count(window, agreed, window_size)
    if before is not None:
        # Eagerly: the window's position is read once, and the selects
        # below are Python's (each `keras.ops` call converts its operands
        # first, a dispatch each on eager backends).
        micro_steps = before + 1
        opens, closes = micro_steps == 1, micro_steps >= int(window_size)
    else:
        # The scalar arithmetic is the tensors' own operators.
        micro_steps = window.micro_steps.value + count
        opens = micro_steps == 1
        closes = micro_steps >= window_size
    if agreed is not None:
        opens = ops.logical_and(opens, agreed)
        closes = ops.logical_and(closes, agreed)
    weight = micro_batch.weight
    counted = 1.0 if weight is None else ops.cast(weight, "float32")
    loss = micro_batch.loss
    # A micro-batch without its loss makes its window report none.
    loss = float("nan") if loss is None else loss
    weighted_loss = loss if weight is None else loss * counted
    present = [i for i, grad in enumerate(grads) if grad is not None]
    if len(present) == len(grads) and agreed is None:
        # Every variable seen, whatever the window saw before.
        seen = np.ones(len(grads), "int32")
    else:
        seen = np.zeros(len(grads), "int32")
        seen[present] = 1
        seen = ops.convert_to_tensor(seen)
        if agreed is not None:
            seen = ops.multiply(seen, count)
        seen = _select(opens, seen, ops.maximum(window.seen.value, seen))
    step = Step(
        enters=agreed,
        opens=opens,
        closes=closes,
        # Masked like the gradients: a weight compiled code refused is
        # NaN, and 0 * NaN would poison the sums.
        weight=None if micro_batch.scaled else masked(weight, agreed),
        scaled=micro_batch.scaled,
        present=present,
        micro_steps=_select(closes, 0, micro_steps),
        micro_batches=window.micro_batches.value + count,
        seen=seen,
        total_weight=_opened_or_added(
            opens, window.total_weight, masked(counted, agreed)
        ),
        loss_sum=_opened_or_added(
            opens, window.loss_sum, masked(weighted_loss, agreed)
        ),
    )
    if agreed is not None:
        left_out = ops.subtract(1, count)
        if micro_batch.refused is not None:
            refused = ops.cast(micro_batch.refused, "int32")
            left_out = ops.subtract(left_out, refused)
            step.refused = ops.add(window.refused.value, refused)
        step.skipped = ops.add(window.skipped.value, left_out)
    if squares is not None:
        step.noise_sums = _noise_sums(
            window, opens, squares, micro_batch, agreed, replicas
        )
    return step


def _left_out(window, micro_batch):
    """The `Step` of a micro-batch known to leave its window: nothing
    moves but the skip count (or the count of refused normalizers)."""
    step = Step(
        enters=False,
        opens=False,
        closes=False,
        weight=None,
        scaled=micro_batch.scaled,
        present=[],
        micro_steps=window.micro_steps.value,
        micro_batches=window.micro_batches.value,
        seen=window.seen.value,
        total_weight=window.total_weight.value,
        loss_sum=window.loss_sum.value,
        skipped=ops.add(window.skipped.value, 1),
    )
    if micro_batch.refused is not None:
        refused = ops.cast(micro_batch.refused, "int32")
        step.skipped = ops.subtract(step.skipped, refused)
        step.refused = ops.add(window.refused.value, refused)
    return step


def _noise_sums(window, opens, squares, micro_batch, agreed, replicas):
    """The window's noise sums after the micro-batch (`noise.py` turns
    them into estimates at the close)."""
    known = concrete_value(squares)
    if known is None:
        sq_norm = ops.sum(squares)
    else:
        # Eagerly, one read of a few numbers to the host, where a
        # `keras.ops` call is a dispatch or more.
        sq_norm = np.float32(known.sum(dtype="float32"))
    if replicas > 1:
        # A replica's gradient arrives divided by the replica count (as
        # Keras' losses scale it): its share's own mean is R times it.
        sq_norm = sq_norm * float(replicas * replicas)
    counts = agreed
    weight = micro_batch.weight
    if weight is None:
        weight = 1.0
    else:
        weight = ops.cast(weight, "float32")
        # A micro-batch (a replica's share) of weight 0 is no sample.
        drawn = ops.greater(weight, 0.0)
        weight = ops.where(drawn, weight, 1.0)
        counts = drawn if agreed is None else ops.logical_and(drawn, agreed)
    if micro_batch.scaled:
        # `fit`'s gradients arrive multiplied by the weight (`scale_loss`):
        # the micro-batch's own mean is theirs over it.
        sq_norm = sq_norm / (weight * weight)
    inverse = 1.0 if isinstance(weight, float) else ops.divide(1.0, weight)
    added = (sq_norm, inverse, 1.0)
    totals = (
        window.noise_sq_norm_sum,
        window.noise_inverse_weight_sum,
        window.noise_micro_batches,
    )
    return tuple(
        _opened_or_added(opens, total, masked(value, counts))
        for total, value in zip(totals, added)
    )


def _known_count(window, agreed, window_size):
    """The window's micro-steps before this one, as a Python int, where
    it and `window_size` are concrete and nothing may leave the
    micro-batch out; else `None` (compiled code)."""
    if agreed is not None:
        return None
    if concrete_value(window_size) is None:
        return None
    before = concrete_value(window.micro_steps.value)
    return None if before is None else int(before)


def _select(pred, if_true, if_false):
    """`if_true` where `pred`, else `if_false`: Python's choice for a
    Python bool."""
    if isinstance(pred, bool):
        return if_true if pred else if_false
    return ops.where(pred, if_true, if_false)


def _opened_or_added(opens, total, added):
    """`added` on the window's first micro-step, else `total + added`."""
    if isinstance(opens, bool):
        # A Python number stays one: the backend writes it as it is.
        if opens:
            return added
        return total.value + added
    added = ops.cast(added, total.dtype)
    return ops.where(opens, added, total.value + added)
