"""torch: in-place `torch._foreach_*` adds, and sums zeroed at the window's
end (eager torch has no fused select to make overwriting cheaper); under
`torch_distributed.sync_windows`, one bucketed all-reduce per window, at
the close or (with `model=`) behind the window's last backward
(`torch_overlap.py`)."""

import torch

from accum_optimizers import _keras_private
from accum_optimizers._backend.base import Accumulation
from accum_optimizers._finite import all_finite
from accum_optimizers._window.spec import resetting_variables


class TorchAccumulation(Accumulation):
    def _accum_begin_apply(self):
        overlap = _overlap_of(self)
        if overlap is not None:
            overlap.claim()

    def _accum_check_gradients(self, grads, weight, scaled):
        overlap = _overlap_of(self)
        if overlap is not None and overlap.claimed is not None:
            overlap.claimed.check(grads, weight, scaled)

    @torch.no_grad()
    def _accum_add(self, sums, grads, new_window, weight=None):
        overlap = _overlap_of(self)
        if overlap is not None and overlap.claimed is not None:
            return  # the last backward added them, into its buffers
        # `_accum_end_window` zeroed the sums: a new window needs no select.
        # A weight known on the host multiplies inside the add (`alpha`).
        alpha = weight if isinstance(weight, float) else 1
        if weight is not None and not isinstance(weight, float):
            grads = self._accum_weighed(sums, grads, weight)
        pairs = [(s, g) for s, g in zip(sums, grads) if g is not None]
        targets = [total.value for total, _ in pairs]
        sources = [
            torch.as_tensor(grad, dtype=target.dtype, device=target.device)
            for (_, grad), target in zip(pairs, targets)
        ]
        if targets:
            _keras_private.torch_foreach_add_(targets, sources, alpha=alpha)

    @torch.no_grad()
    def _accum_reduce_window(self, sums, extras, total_weight):
        sync = window_sync(self)
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

    def _accum_finite_everywhere(self, finite):
        sync = window_sync(self)
        if sync is None:
            return finite
        if sync.overlap is not None:
            # `flush` after a backward no `apply` took: its exchange is
            # dropped, on every rank.
            sync.overlap.discard_current()
        # Under `sync_windows` every rank must take the same branch of
        # `flush`: the window's all-reduce is collective.
        flag = torch.tensor([int(finite)], dtype=torch.int32)
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MIN, group=sync.process_group
        )
        return bool(flag.item())

    def _accum_agree_finite(self, finite):
        sync = window_sync(self)
        if sync is None:
            return finite
        if sync.overlap is not None and sync.overlap.finite_agreed:
            return finite  # read in the reduced buffers, alike everywhere
        flag = torch.as_tensor(finite, dtype=torch.int32).reshape(1)
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MIN, group=sync.process_group
        )
        return flag[0] > 0

    @torch.no_grad()
    def _accum_window_mean(self, totals, count):
        # In place: `totals` are the sums, which `_accum_end_window` zeroes
        # next; new tensors would cost an allocation per variable.
        if totals:
            _keras_private.torch_foreach_div_(totals, count)
        return totals

    @torch.no_grad()
    def _accum_end_window(self):
        variables = self._accum_sums + resetting_variables(self)
        _keras_private.torch_foreach_zero_(
            [variable.value for variable in variables]
        )

    def _accum_note_loss(self, loss):
        super()._accum_note_loss(loss.detach())

    def _accum_all_finite(self, grads, squares=None):
        overlap = _overlap_of(self)
        if overlap is not None and overlap.claimed is not None:
            # Exact without reading the gradients first: the earlier
            # micro-steps' sums are finite (checked then), so the reduced
            # `sum + grad` of every rank is finite exactly when every
            # rank's gradients are (but for a sum overflowing float32).
            finite = overlap.claimed.all_finite()
            overlap.finite_agreed = True
            if not finite:
                overlap.discard_claimed()  # the sums were never written
            return finite
        # torch's own sums: a `keras.ops` call costs more than the sum of a
        # small gradient.
        return all_finite(
            grads, sums_are_finite=_sums_are_finite, squares=squares
        )

    @torch.no_grad()
    def _accum_sums_of_squares(self, grads):
        # One fused kernel per gradient (`torch.linalg.vector_norm` squares
        # and sums in one pass), without `keras.ops`' per-call cost.
        return [
            torch.linalg.vector_norm(
                torch.as_tensor(grad), dtype=torch.float32
            ).square()
            for grad in grads
            if grad is not None
        ]


class WindowSync:
    """How an optimizer's windows cross ranks (`sync_windows`).

    Args:
        process_group: the `torch.distributed` process group, or `None`
            for the default one.
        bucket_bytes: the most bytes of sums one all-reduce carries.
        overlap: the last backward's hooks (a `torch_overlap.Overlap`), or
            `None`: the exchange runs at the close.
    """

    def __init__(self, process_group, bucket_bytes, overlap):
        self.process_group = process_group
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap


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


@torch.no_grad()
def _sums_are_finite(values):
    """Whether the sum of each of `values` is finite (a 0-d bool tensor)."""
    sums = [torch.as_tensor(value).sum() for value in values]
    return torch.stack(sums).isfinite().all()
