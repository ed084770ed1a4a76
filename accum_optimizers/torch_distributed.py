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
With `model=`, the exchange starts during the window's last backward, a
bucket at a time as its gradients are ready, as DDP hides its own behind
the backward pass; the close only waits for it.
"""

from __future__ import annotations

from typing import Any

import keras

from accum_optimizers._backend import NEEDS_WINDOW_SYNC
from accum_optimizers._validation import is_real_number

# DDP's default bucket size (`bucket_cap_mb`).
DEFAULT_BUCKET_CAP_MB = 25


def sync_windows(
    optimizer: keras.optimizers.Optimizer,
    process_group: Any = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    model: keras.Model | None = None,
) -> keras.optimizers.Optimizer:
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
        process_group: the `torch.distributed.ProcessGroup` to reduce
            over. Defaults to `None`, the default (world) group, which
            `torch.distributed.init_process_group` must have made.
        bucket_cap_mb: the most megabytes (MiB) of sums one all-reduce
            carries. Without `model` one bucket's copy is the only extra
            memory the exchange takes; with `model`, every bucket's copy
            lives from the last backward to the close (up to the size of
            the sums). Defaults to 25, DDP's bucket size.
        model: Optional: the bare Keras model whose trainable variables
            `optimizer` updates (not the `DistributedDataParallel`
            wrapper). Hooks on its parameters start each bucket's
            all-reduce during the window's last backward, as soon as the
            bucket's gradients exist, and the close waits for them. Then
            `apply` must receive exactly the `.grad` that backward
            produced, one backward per `apply`; a weighted window's last
            weight must be announced before its backward
            (`weigh_next_backward`), and `weigh_micro_batches` is refused.
            `skip_nonfinite` stays exact: the last micro-batch's
            finiteness is read in the reduced sums.
            Defaults to `None`: the exchange runs at the close.

    Returns:
        `optimizer`.

    Raises:
        ValueError: off the torch backend, without an initialized process
            group, or for an optimizer or argument that cannot take part,
            named with its value.
    """
    if not NEEDS_WINDOW_SYNC:
        raise ValueError(
            "sync_windows() needs the torch backend; got "
            f"KERAS_BACKEND={keras.backend.backend()!r}. TensorFlow and JAX "
            "reduce once per window on their own."
        )
    import torch.distributed as dist

    from accum_optimizers._accumulation import GradientAccumulation
    from accum_optimizers._backend.torch import WindowSync
    from accum_optimizers._backend.torch import set_window_sync
    from accum_optimizers._backend.torch import window_sync

    if not isinstance(optimizer, GradientAccumulation):
        raise ValueError(
            "sync_windows() needs an accumulating optimizer; got "
            f"optimizer={optimizer!r}."
        )
    if not optimizer._has_window:
        raise ValueError(
            "sync_windows() needs accum_iters other than 1; got "
            f"accum_iters={optimizer.accum_iters!r}. With a window of one "
            "the parent optimizer runs unchanged: let DDP exchange the "
            "gradients."
        )
    if not (is_real_number(bucket_cap_mb) and 0 < bucket_cap_mb < float("inf")):
        raise ValueError(
            "`bucket_cap_mb` must be a finite number > 0. Received: "
            f"bucket_cap_mb={bucket_cap_mb!r}"
        )
    if model is not None and not hasattr(model, "trainable_variables"):
        raise ValueError(
            "sync_windows(model=...) needs the bare Keras model whose "
            "variables the optimizer updates (not its "
            f"DistributedDataParallel wrapper); got model={model!r}."
        )
    if model is not None and not model.trainable_variables:
        raise ValueError(
            "sync_windows(model=...) hooks the model's trainable variables, "
            "and the model has none yet: build it (call it once, or "
            f"`model.build(...)`) first. Received: model={model.name!r} "
            "with no trainable variables."
        )
    if model is not None and getattr(optimizer, "measure_noise_scale", False):
        raise ValueError(
            "sync_windows(model=...) exchanges the window's last gradients "
            "during the backward pass, before the measurement of the noise "
            "scale reads them: the two together are not supported yet. Pass "
            "model=None (the exchange at the window's close) or "
            "measure_noise_scale=False. Received: model="
            f"{model.name!r}, measure_noise_scale=True"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "sync_windows() needs torch.distributed initialized "
            "(torch.distributed.init_process_group) before it is called."
        )
    bucket_bytes = int(bucket_cap_mb * 2**20)
    old = window_sync(optimizer)
    if old is not None and old.overlap is not None:
        old.overlap.remove()
    overlap = None
    if model is not None:
        from accum_optimizers._backend.torch_overlap import Overlap

        overlap = Overlap(optimizer, model, process_group, bucket_bytes)
    set_window_sync(optimizer, WindowSync(process_group, bucket_bytes, overlap))
    return optimizer


def weigh_next_backward(
    optimizer: keras.optimizers.Optimizer, weight: Any
) -> None:
    """Announces the weight of the micro-batch whose backward runs next.

    Under `sync_windows(optimizer, model=model)` the window's exchange
    starts during its last backward, before `apply` receives the weight of
    that micro-batch: for a weighted window (`apply(..., weight=n)`), call
    this before each backward with the `n` that its `apply` will receive
    (it is needed only before the backward that closes a window, and the
    optimizer uses it only there). The announcement holds for one backward
    and `apply`; an `apply` on the window's last micro-batch whose weight
    differs from the one announced raises before changing anything.

    Args:
        optimizer: the accumulating optimizer, under `sync_windows` with
            `model`.
        weight: the micro-batch's weight, a finite number `> 0` (its sample
            count, the sum of its sample weights, or its token count), as
            `apply` takes it.

    Raises:
        ValueError: if `optimizer` is not under `sync_windows` with
            `model`, a backward already ran since the last `apply`, or
            `weight` is not a finite number `> 0`.
    """
    import numpy as np

    from accum_optimizers._backend.torch import window_sync
    from accum_optimizers._validation import validate_weight

    sync = window_sync(optimizer)
    if sync is None or sync.overlap is None:
        raise ValueError(
            "weigh_next_backward() is for an optimizer under "
            "sync_windows(optimizer, model=...), whose exchange starts "
            "during the window's last backward; without `model`, pass the "
            f"weight to `apply` alone. Received: optimizer={optimizer!r}"
        )
    if sync.overlap.current is not None:
        raise ValueError(
            "weigh_next_backward() must be called before the backward it "
            "weighs; a backward already ran since the last `apply`. "
            f"Received: weight={weight!r}"
        )
    value = np.asarray(keras.ops.convert_to_numpy(weight))
    sync.overlap.next_weight = validate_weight(value, weight)
