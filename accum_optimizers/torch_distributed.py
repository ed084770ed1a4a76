"""torch.distributed: the window's sums cross ranks once per window.

Keras' torch backend has no `keras.distribution`; several torch processes
train a Keras model with `torch.distributed` (Keras' guide "Multi-GPU
distributed training with PyTorch" wraps it in `DistributedDataParallel`).
DDP all-reduces the gradients in every `backward`, so once per micro-step.
`sync_windows(optimizer)` moves the exchange to the window's close: every
rank accumulates its own gradients, and when the window is full the ranks'
sums and total weights are added in one bucketed all-reduce, before the
parent optimizer's update. The user runs every micro-step's backward
without DDP's exchange (under `ddp.no_sync()`, or without DDP at all).
"""

import keras

# DDP's default bucket size (`bucket_cap_mb`).
DEFAULT_BUCKET_CAP_MB = 25


class _WindowSync:
    """What `sync_windows` attached: the process group and bucket size."""

    def __init__(self, process_group, bucket_cap_mb):
        self.process_group = process_group
        self.bucket_bytes = int(bucket_cap_mb * 2**20)


def sync_windows(
    optimizer, process_group=None, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB
):
    """Makes `optimizer` all-reduce its window's sums once per window.

    From now on, each time a window closes (its `accum_iters`-th `apply`,
    or `flush`), the ranks' sums of gradients and total weights are added
    over `process_group`, in one all-reduce per bucket, and every rank
    applies the same update: the mean gradient of the window's global
    batch, as one process would on the concatenated batch of every rank.
    Each rank's loss is the mean over its own micro-batch, as with DDP (or
    pass `weight=` to `apply`: the sum of the weights is taken over every
    rank's micro-batches).

    The micro-steps' gradients must not cross ranks: run the forward and
    backward passes under `ddp.no_sync()` (all of them, the window's last
    one too), or on the bare model. Every rank must close its windows
    together (the same `accum_iters`, and `flush` called on every rank at
    once), because the all-reduce is collective; `flush` discards the
    window on every rank when any rank's holds a non-finite gradient. Start
    every rank from the same weights (DDP broadcasts rank 0's when it wraps the
    model).

    Args:
        optimizer: an accumulating optimizer (`AdamAccumulate` and the
            others, or `accumulating(cls)`), with `accum_iters` other than
            1: with a window of one the parent optimizer runs unchanged,
            and DDP's own exchange is the one to use.
        process_group: the `torch.distributed` process group to reduce
            over. Defaults to `None`, the default (world) group, which
            `torch.distributed.init_process_group` must have made.
        bucket_cap_mb: the most megabytes (MiB) of sums one all-reduce
            carries (the only extra memory the exchange takes). Defaults to
            25, DDP's bucket size.

    Returns:
        `optimizer`.
    """
    if keras.backend.backend() != "torch":
        raise ValueError(
            "sync_windows() needs the torch backend; got "
            f"KERAS_BACKEND={keras.backend.backend()!r}. TensorFlow and JAX "
            "reduce once per window on their own."
        )
    import torch.distributed as dist

    from accum_optimizers._accumulation import GradientAccumulation

    if not isinstance(optimizer, GradientAccumulation):
        raise ValueError(
            "sync_windows() needs an accumulating optimizer; got "
            f"optimizer={optimizer!r}."
        )
    if not optimizer._accumulates:
        raise ValueError(
            "sync_windows() needs accum_iters other than 1; got "
            f"accum_iters={optimizer.accum_iters!r}. With a window of one "
            "the parent optimizer runs unchanged: let DDP exchange the "
            "gradients."
        )
    if not bucket_cap_mb > 0:
        raise ValueError(
            f"bucket_cap_mb must be > 0; got bucket_cap_mb={bucket_cap_mb!r}."
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "sync_windows() needs torch.distributed initialized "
            "(torch.distributed.init_process_group) before it is called."
        )
    optimizer._accum_window_sync = _WindowSync(process_group, bucket_cap_mb)
    return optimizer
