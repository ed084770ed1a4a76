"""torch: the window's exchange behind its last backward
(`sync_windows(optimizer, model=model)`).

DDP hides its all-reduces behind the backward pass: a bucket's exchange
starts as soon as its gradients exist. Here the same happens once per
window. A hook on every model parameter (`register_post_accumulate_grad_hook`)
sees each gradient as the backward produces it; during the backward whose
`apply` will close the window, it takes the gradient, and when every
gradient of a bucket is in, writes `sum + grad` of the bucket's variables
into one flat buffer and starts that buffer's all-reduce
(`async_op=True`). The sums themselves are not written then: `apply`
still checks the call first, and the close (or a skip) waits for the
exchanges and copies the reduced buffers into the sums, so a call that
raises leaves the window as it was.

Buckets are launched in one fixed order on every rank (the collectives
must match): the optimizer's variables from last to first, as the backward
produces them, each bucket only once every bucket before it is launched
(DDP's rule). A variable whose gradient the backward does not produce holds
its bucket, and the ones after it, until the close.
"""

import dataclasses

import torch

from accum_optimizers import _keras_private


class Overlap:
    """The hooks and the state of the window's last backward, for one
    optimizer and one model.

    Args:
        optimizer: the accumulating optimizer under `sync_windows`.
        model: the bare Keras model whose trainable variables `optimizer`
            updates (not the `DistributedDataParallel` wrapper).
        process_group: the group to all-reduce over (`None`: the world).
        bucket_bytes: the most bytes of sums one all-reduce carries.
    """

    def __init__(self, optimizer, model, process_group, bucket_bytes):
        self.optimizer = optimizer
        self.process_group = process_group
        self.bucket_bytes = bucket_bytes
        # The backward under way: `None` until its first gradient, then
        # a `LastBackward`, or `False` where it does not close a window.
        self.current = None
        # The `LastBackward` the running `apply` took over, if any.
        self.claimed = None
        # Whether the running `apply` found its finiteness in the reduced
        # buffers (the same on every rank: no further agreement needed).
        self.finite_agreed = False
        # The weight announced for the next backward
        # (`torch_distributed.weigh_next_backward`), a float or `None`.
        self.next_weight = None
        self.handles = [
            variable.value.register_post_accumulate_grad_hook(self._on_grad)
            for variable in model.trainable_variables
        ]

    def _on_grad(self, parameter):
        """The hook: `parameter`'s gradient is accumulated in `.grad`."""
        last = self.current
        if last is None:
            last = self.current = self._arm()
        if last:
            last.take(parameter)

    def _arm(self):
        """A `LastBackward` where the next `apply` closes the window, else
        `False` (read once per backward, on its first gradient)."""
        optimizer = self.optimizer
        if not optimizer.built:
            return False
        pending = int(optimizer.micro_steps)
        if pending + 1 < optimizer.current_accum_iters:
            return False
        overwritten = [
            _keras_private.overwrites_with_gradient(optimizer, variable)
            for variable in _keras_private.trainable_variables(optimizer)
        ]
        summed = [i for i, over in enumerate(overwritten) if not over]
        return LastBackward(
            _keras_private.trainable_variables(optimizer),
            {i: optimizer._window.sums[i].value for i in summed},
            self.bucket_bytes,
            self.process_group,
            self.next_weight,
            fresh=pending == 0,
        )

    def claim(self):
        """Called as `apply` starts: the backward that ran since the last
        `apply` is this call's (`claimed`); the next backward arms anew."""
        self.discard_claimed()
        last, self.current = self.current, None
        self.claimed = last or None
        self.finite_agreed = False
        self.next_weight = None  # announced for one backward only
        return self.claimed

    def discard_current(self):
        """Drops the exchange of a backward no `apply` will take (a refused
        call, a `flush` after it), once its collectives are done."""
        last, self.current = self.current, None
        if last:
            last.wait()

    def discard_claimed(self):
        """Drops the claimed exchange (a skipped micro-batch, a call that
        raised), once its collectives are done."""
        last, self.claimed = self.claimed, None
        if last is not None:
            last.wait()

    def remove(self):
        """Removes the hooks."""
        for handle in self.handles:
            handle.remove()


class LastBackward:
    """The buckets of the window's last backward.

    Args:
        variables: the optimizer's trainable variables.
        sums: `{variable index: its sum (a torch tensor)}` for the summed
            variables.
        bucket_bytes: the most bytes of sums one bucket holds.
        process_group: the group to all-reduce over.
        weight: the micro-batch's weight announced before the backward (a
            float), or `None` (it counts 1).
        fresh: whether the backward's micro-batch opens its window: the
            sums hold the last window's values, and count zero.
    """

    def __init__(
        self, variables, sums, bucket_bytes, process_group, weight, fresh
    ):
        from accum_optimizers._backend.torch import _buckets

        self.process_group = process_group
        self.weight = weight
        self.fresh = fresh
        order = sorted(sums, reverse=True)
        self.index_of = {id(variables[i].value): i for i in order}
        self.grads = {}
        self.buckets = []
        self.bucket_of = {}
        start = 0
        for group in _buckets([sums[i] for i in order], bucket_bytes):
            indices = order[start : start + len(group)]
            start += len(group)
            for i in indices:
                self.bucket_of[i] = len(self.buckets)
            self.buckets.append(_Bucket(indices, group))
        self.launched = 0

    def take(self, parameter):
        """Takes `parameter.grad` (a hook, during the backward) and starts
        every bucket that is now ready, in order."""
        index = self.index_of.get(id(parameter))
        if index is None:
            return
        if index in self.grads:
            raise RuntimeError(
                "sync_windows(model=...): a second backward pass ran before "
                "the `apply` that closes the window; the window's exchange "
                "starts during its last backward, so run one backward per "
                "`apply`."
            )
        self.grads[index] = parameter.grad
        self.buckets[self.bucket_of[index]].waiting -= 1
        while (
            self.launched < len(self.buckets)
            and self.buckets[self.launched].waiting == 0
        ):
            self._launch(self.buckets[self.launched])

    @torch.no_grad()
    def _launch(self, bucket):
        """Writes `bucket`'s `sum + weight * grad` into its flat buffer and
        starts the buffer's all-reduce."""
        self.launched += 1
        bucket.flat = torch.empty(
            sum(s.numel() for s in bucket.sums),
            dtype=bucket.sums[0].dtype,
            device=bucket.sums[0].device,
        )
        offset = 0
        for index, total in zip(bucket.indices, bucket.sums):
            piece = bucket.flat[offset : offset + total.numel()]
            offset += total.numel()
            grad = self.grads.get(index)
            if grad is None and self.fresh:
                piece.zero_()
            elif grad is None:
                piece.copy_(total.reshape(-1))
            else:
                # What the backend's `commit` computes, in the sum's dtype.
                grad = grad.reshape(-1).to(total.dtype)
                alpha = 1 if self.weight is None else self.weight
                base = torch.zeros_like(piece) if self.fresh else total
                torch.add(base.reshape(-1), grad, alpha=alpha, out=piece)
        bucket.handle = torch.distributed.all_reduce(
            bucket.flat, group=self.process_group, async_op=True
        )

    def check(self, grads, weight, scaled):
        """Raises unless `grads` (one per variable, as `apply` lays them
        out) are the gradients this backward produced, and `weight` (the
        call's, checked: a float or `None`) is the one announced for it.
        `scaled`: the gradients arrive multiplied by `weight` (`fit` with
        `weigh_micro_batches`)."""
        if scaled:
            raise ValueError(
                "weigh_micro_batches cannot be used with "
                "sync_windows(model=...): the window's exchange starts during "
                "its last backward, inside `fit`, before the micro-batch's "
                "weight reaches the optimizer. Call sync_windows without "
                "`model`. Received: weigh_micro_batches with "
                "sync_windows(model=...)"
            )
        # No weight counts 1, as in `apply`.
        if (1.0 if weight is None else weight) != (self.weight or 1.0):
            announced = (
                "no weight was announced before its backward"
                if self.weight is None
                else f"weigh_next_backward(optimizer, {self.weight!r}) "
                "announced another"
            )
            raise ValueError(
                "sync_windows(model=...): the exchange of the window's last "
                "micro-batch starts during its backward, so its weight must "
                "be announced before it (weigh_next_backward); "
                f"{announced}. Received: weight={weight!r}, "
                f"announced={self.weight!r}"
            )
        for index in self.bucket_of:
            taken = self.grads.get(index)
            grad = grads[index]
            same = (taken is None and grad is None) or (
                taken is not None
                and grad is not None
                and (grad is taken or _same_tensor(grad, taken))
            )
            if not same:
                raise ValueError(
                    "sync_windows(model=...): `apply` must receive the "
                    "`.grad` the window's last backward produced (its "
                    "exchange started during that backward). Received a "
                    "different gradient for variable index "
                    f"{index}: {_describe(grad)}, the backward's: "
                    f"{_describe(taken)}."
                )

    def wait(self):
        """Starts what the backward left unstarted (variables without a
        gradient), and waits for every bucket's all-reduce."""
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None

    @torch.no_grad()
    def all_finite(self):
        """Whether every reduced buffer is finite (the same on every rank:
        the buffers are the ranks' sums)."""
        self.wait()
        flags = [bucket.flat.isfinite().all() for bucket in self.buckets]
        return bool(torch.stack(flags).all())

    @torch.no_grad()
    def commit(self):
        """Writes the reduced buffers into the sums, and frees them."""
        self.wait()
        for bucket in self.buckets:
            views = torch.split(bucket.flat, [s.numel() for s in bucket.sums])
            _keras_private.torch_foreach_copy_(
                bucket.sums,
                [v.view_as(s) for v, s in zip(views, bucket.sums)],
            )
            bucket.flat = None


@dataclasses.dataclass(eq=False)
class _Bucket:
    """One bucket: its variables' indices and sums, the gradients it still
    waits for, its flat buffer and its all-reduce's handle."""

    indices: list
    sums: list
    flat: object = None
    handle: object = None

    def __post_init__(self):
        self.waiting = len(self.indices)


def _same_tensor(a, b):
    """Whether `a` is a tensor over the same memory as the tensor `b`, with
    its shape, strides and dtype (`b` seen through another wrapper)."""
    return (
        isinstance(a, torch.Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _describe(grad):
    """`grad` (a tensor or `None`) in an error message."""
    if grad is None:
        return "None"
    return f"a tensor of shape {tuple(grad.shape)}"
