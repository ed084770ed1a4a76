"""torch: in-place `torch._foreach_*` writes (eager torch has no fused
select: the window's first micro-step copies into its sums instead of
adding); under `torch_distributed.sync_windows`, one bucketed all-reduce
per window, at the close or (with `model=`) behind the window's last
backward (`torch_overlap.py`)."""

import dataclasses

import numpy as np
import torch

from accum_optimizers import _keras_private
from accum_optimizers._backend import base
from accum_optimizers._backend.base import counter_writes
from accum_optimizers._backend.base import keep_maximum
from accum_optimizers._backend.base import scaled
from accum_optimizers._backend.base import targets
from accum_optimizers._finite import all_finite


class WindowBackend(base.WindowBackend):
    def begin(self, flushing=False):
        overlap = _overlap_of(self.optimizer)
        if overlap is None:
            return
        if flushing:
            # A backward no `apply` took: its exchange is dropped, on
            # every rank.
            overlap.discard_current()
        else:
            overlap.claim()

    def read_gradients(self, grads, squares, finite):
        overlap = _overlap_of(self.optimizer)
        sq = sums_of_squares(grads) if squares else None
        if not finite:
            return sq, None
        if overlap is not None and overlap.claimed is not None:
            # Exact without reading the gradients first: the earlier
            # micro-steps' sums are finite (checked then), so the reduced
            # `sum + grad` of every rank is finite exactly when every
            # rank's gradients are (but for a sum overflowing float32).
            is_finite = overlap.claimed.all_finite()
            overlap.finite_agreed = True
            if not is_finite:
                overlap.discard_claimed()  # the sums were never written
            return sq, is_finite
        # The norms answer for the sums: one fused call, where a sum each
        # is a dispatch each.
        norms = sums_of_squares(grads) if sq is None else sq
        return sq, all_finite(grads, squares=norms)

    def agree(self, flag):
        sync = window_sync(self.optimizer)
        if sync is None:
            return flag
        if sync.overlap is not None and sync.overlap.finite_agreed:
            return flag  # read in the reduced buffers, alike everywhere
        # Every rank must take the same branch: the window's all-reduce is
        # collective.
        reduced = torch.as_tensor(flag, dtype=torch.int32).reshape(1)
        torch.distributed.all_reduce(
            reduced, op=torch.distributed.ReduceOp.MIN, group=sync.process_group
        )
        if isinstance(flag, bool):
            return bool(reduced.item())
        return reduced[0] > 0

    @torch.no_grad()
    def commit(self, window, step, grads, close):
        overlap = _overlap_of(self.optimizer)
        claimed = overlap is not None and overlap.claimed is not None
        if claimed:
            # Before any write: the backward's gradients must be the call's.
            overlap.claimed.check(grads, step.weight, step.scaled)
        assign(counter_writes(window, step))
        if step.enters is None or bool(step.enters):
            if not claimed:  # else the last backward added them
                self._add(window, step, grads)
        if bool(step.closes):
            close()

    def _add(self, window, step, grads):
        """`sum += weight * grad`, or `sum = weight * grad` (zero for
        `None`) on the window's first micro-step, in place. A weight known
        on the host multiplies inside the add (`alpha`)."""
        opens = bool(step.opens)
        weight = step.weight
        alpha = weight if isinstance(weight, float) else 1
        pairs, absent = [], []
        for total, grad, overwrite in targets(self.optimizer, window, grads):
            if overwrite:
                keep_maximum(total, grad, step)
            elif grad is None:
                absent.append(total.value)
            else:
                if not isinstance(weight, (float, type(None))):
                    grad = scaled(grad, weight, total.dtype)
                target = total.value
                pairs.append((target, _tensor(grad, like=target)))
        targets_, sources = [p[0] for p in pairs], [p[1] for p in pairs]
        if opens and absent:
            _keras_private.torch_foreach_zero_(absent)
        if not targets_:
            return
        if opens and alpha == 1:
            _keras_private.torch_foreach_copy_(targets_, sources)
            return
        if opens:
            _keras_private.torch_foreach_zero_(targets_)
        _keras_private.torch_foreach_add_(targets_, sources, alpha=alpha)

    @torch.no_grad()
    def reduce_window(self, sums, extras, total_weight):
        sync = window_sync(self.optimizer)
        if sync is None:
            return sums, extras, total_weight
        # Each rank's sums are of its own micro-batches' mean gradients,
        # each micro-batch weighing 1 (or its `weight`): the global mean is
        # the ranks' summed sums over their summed weights. In place: the
        # sums and the weight are the window's own, dead after it. Every
        # rank sends every sum, with or without gradient, so that the ranks
        # exchange the same tensors.
        tensors = list(sums) + list(extras) + [total_weight]
        overlap = sync.overlap
        if overlap is not None and overlap.claimed is not None:
            # The gradient sums crossed behind the last backward; the
            # extras and the total weight, known only now, cross here.
            overlap.claimed.commit()
            overlap.claimed = None
            tensors = list(extras) + [total_weight]
        for bucket in _buckets(tensors, sync.bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            torch.distributed.all_reduce(flat, group=sync.process_group)
            views = torch.split(flat, [t.numel() for t in bucket])
            _keras_private.torch_foreach_copy_(
                bucket, [v.view_as(t) for v, t in zip(views, bucket)]
            )
        return sums, extras, total_weight

    @torch.no_grad()
    def mean(self, sums, totals, divisor):
        # In place: `totals` are the sums, dead until the next window's
        # first micro-step overwrites them; new tensors would cost an
        # allocation per variable.
        if totals:
            _keras_private.torch_foreach_div_(totals, divisor)
        return totals


@torch.no_grad()
def assign(writes):
    # The tensors in one `_foreach_copy_` (a kernel on a GPU, where an
    # `assign` each is one launch each), a number by `fill_`, without
    # making a tensor of it first.
    targets_, values = [], []
    for variable, value in writes:
        target = variable.value
        if isinstance(value, (int, float, np.generic)):
            target.fill_(value)
            continue
        targets_.append(target)
        values.append(_tensor(value, like=target))
    if targets_:
        _keras_private.torch_foreach_copy_(targets_, values)


@torch.no_grad()
def sums_of_squares(tensors):
    # In torch (`_keras_private`), without `keras.ops`' per-call cost.
    tensors = [_tensor(t) for t in tensors if t is not None]
    if not tensors:
        return torch.zeros((0,), dtype=torch.float32)
    return _keras_private.torch_foreach_sums_of_squares(tensors)


def _tensor(value, like=None):
    """`value` as a torch tensor (of `like`'s dtype and device), converted
    only where it is not one: `torch.as_tensor` of a tensor is still a
    dispatch."""
    if isinstance(value, torch.Tensor) and (
        like is None
        or (value.dtype == like.dtype and value.device == like.device)
    ):
        return value
    if like is None:
        return torch.as_tensor(value)
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def kept_loss(loss):
    return loss.detach()


colocate = base.colocate
outside_compiled_code = base.outside_compiled_code
replica_count = base.replica_count
zero_weight_allowed = base.zero_weight_allowed
train_step_loss = base.train_step_loss


@dataclasses.dataclass
class WindowSync:
    """How an optimizer's windows cross ranks (`sync_windows`).

    Args:
        process_group: the `torch.distributed` process group, or `None`
            for the default one.
        bucket_bytes: the most bytes of sums one all-reduce carries.
        overlap: the last backward's hooks (a `torch_overlap.Overlap`), or
            `None`: the exchange runs at the close.
    """

    process_group: object
    bucket_bytes: int
    overlap: object


def window_sync(optimizer):
    """The `WindowSync` `sync_windows` gave `optimizer`, or `None`."""
    return getattr(optimizer, "_accum_window_sync", None)


def set_window_sync(optimizer, sync):
    """Makes `optimizer`'s windows cross ranks as `sync` (a `WindowSync`)
    says, from its next close on."""
    optimizer._accum_window_sync = sync


def _overlap_of(optimizer):
    """The `torch_overlap.Overlap` of `optimizer`, or `None`."""
    sync = window_sync(optimizer)
    return None if sync is None else sync.overlap


def _buckets(tensors, bucket_bytes):
    """`tensors` in consecutive groups of one dtype and device, each of at
    most `bucket_bytes` (or one tensor, where a tensor is larger)."""
    bucket, size = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (
            size + nbytes > bucket_bytes
            or tensor.dtype != bucket[0].dtype
            or tensor.device != bucket[0].device
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket
