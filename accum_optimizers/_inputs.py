"""Values an accumulating optimizer's `apply` receives beside its arguments.

Keras' trainers and wrappers call `optimizer.apply(grads)` only; a window
also needs, known earlier in the same thread:

- the micro-batch's weight (`weigh_micro_batches`, while the loss is
  computed; `LossScaleOptimizer.apply(weight=)` and `stateless_apply`);
- its loss (`scale_loss`; on JAX the train step's loss is read instead);
- whether its gradients are finite, where a wrapper checked all of them
  (`MultiOptimizer`, so that its inner optimizers skip together).

Each is put here per optimizer and per thread (`tf.distribute` replicas run
in threads of their own) and taken all at once by that optimizer's next
`apply`. A wrapper whose `apply` raises or skips discards what is left, so
nothing carries over to the next micro-batch.

The Keras loss reductions of a micro-batch's loss (from which
`weigh_micro_batches` reads the count the loss was divided by) are
recorded here too, by `_keras_private`'s wrapper of
`reduce_weighted_values` (`record_loss_reductions`).
"""

import contextlib
import dataclasses
import threading
import weakref
from typing import Any

_local = threading.local()


# `eq=False` on these records: their fields hold tensors, which `==`
# compares elementwise; each record is compared by identity.
@dataclasses.dataclass(eq=False)
class Handoff:
    """The weight of an optimizer's next `apply`.

    Args:
        weight: the micro-batch's weight (a number or a scalar tensor).
        loss_scaled: whether `scale_loss` multiplied the loss by it, so that
            the gradients arrive weighed.
        check: whether to refuse a weight that is not finite and `> 0` (a
            user's `weight`; `fit`'s normalizers may be `0`).
        checked: `None`, or a function returning the context in which the
            call's state changes run: that of the caller's own check of the
            weight (`fit`'s normalizers, checked in a TensorFlow graph).
        may_be_invalid: whether the weight is NaN where the caller could
            not refuse it (compiled code that cannot raise): the micro-batch
            is then left out of its window.
        refused: `None`, or a traced bool: whether the weight was made NaN
            for a refused loss normalizer (not for a non-finite micro-batch
            that `skip_nonfinite` skips).
    """

    weight: Any
    loss_scaled: bool = False
    check: bool = False
    checked: Any = None
    may_be_invalid: bool = False
    refused: Any = None


@dataclasses.dataclass(eq=False)
class Pending:
    """What an optimizer's next `apply` takes: `handoff` (a `Handoff` or
    `None`), `loss` and `finite` (`None` where none was put); `owner`, a
    weak reference to the optimizer it was put for."""

    handoff: Any = None
    loss: Any = None
    finite: Any = None
    owner: Any = None


def _pending():
    """This thread's `{id(optimizer): Pending}`."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = {}
    return pending


def _own(entry, optimizer):
    """`entry` where it was put for `optimizer`, else `None`: an entry left
    by an optimizer since collected must not reach a new one that Python
    gave the same `id`."""
    if entry is None or entry.owner() is not optimizer:
        return None
    return entry


def _entry(optimizer):
    pending = _pending()
    entry = _own(pending.get(id(optimizer)), optimizer)
    if entry is None:
        entry = pending[id(optimizer)] = Pending(owner=weakref.ref(optimizer))
    return entry


def hand_over(optimizer, handoff):
    """Sets the `Handoff` of `optimizer`'s next `apply` in this thread."""
    _entry(optimizer).handoff = handoff


def put_loss(optimizer, loss):
    """Sets the loss of `optimizer`'s next `apply` in this thread."""
    _entry(optimizer).loss = loss


def put_finite(optimizer, finite):
    """Sets whether the gradients of `optimizer`'s next `apply` are finite
    (a wrapper's check of every gradient)."""
    _entry(optimizer).finite = finite


def handoff_of(optimizer):
    """The `Handoff` set for `optimizer`'s next `apply`, left in place."""
    entry = _own(_pending().get(id(optimizer)), optimizer)
    return None if entry is None else entry.handoff


def peek(optimizer):
    """What was put for `optimizer`'s next `apply`, left in place: a
    `Pending`."""
    return _own(_pending().get(id(optimizer)), optimizer) or Pending()


def take(optimizer):
    """What was put for `optimizer`'s next `apply`, removed: a `Pending`."""
    return _own(_pending().pop(id(optimizer), None), optimizer) or Pending()


def discard(optimizer):
    """Drops what was put for `optimizer` and not taken (its `apply`
    raised, or a wrapper skipped it)."""
    _pending().pop(id(optimizer), None)


@contextlib.contextmanager
def record_loss_reductions():
    """Context that yields a list collecting the loss reductions noted in
    this thread inside it (`loss_reductions_recording`). Nested, the
    innermost collects."""
    recordings = getattr(_local, "loss_reductions", None)
    if recordings is None:
        recordings = _local.loss_reductions = []
    records = []
    recordings.append(records)
    try:
        yield records
    finally:
        recordings.pop()


def loss_reductions_recording():
    """The list of this thread's innermost `record_loss_reductions`, where
    a loss reduction is to be added, or `None` outside one."""
    recordings = getattr(_local, "loss_reductions", None)
    return recordings[-1] if recordings else None
