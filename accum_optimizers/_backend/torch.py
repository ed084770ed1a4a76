"""torch pieces of the accumulation mechanism (see `__init__`)."""

import contextlib

import torch
from keras.src import optimizers
from keras.src.backend.torch.optimizers import torch_adam
from keras.src.backend.torch.optimizers import torch_rmsprop
from keras.src.backend.torch.optimizers import torch_sgd

# Keras' `TorchOptimizer.__new__` swaps these fused (`torch._foreach_*`)
# classes in for its own exact classes only; a subclass of the plain class
# would fall back to a per-variable loop.
_FUSED = {
    optimizers.Adam: torch_adam.Adam,
    optimizers.RMSprop: torch_rmsprop.RMSprop,
    optimizers.SGD: torch_sgd.SGD,
}


def fused_parent(parent):
    return _FUSED.get(parent, parent)


def colocate_with(optimizer, variable):
    return contextlib.nullcontext()


def accumulate(
    optimizer, accumulators, grads, micro_steps, update_switch, apply_window
):
    # `end_window` zeroed the accumulators: no first-micro-step case.
    _add_into(accumulators, grads)
    run_if(
        optimizer,
        update_switch,
        lambda: apply_window([a.value for a in accumulators]),
    )


@torch.no_grad()
def _add_into(accumulators, grads):
    pairs = [(a, g) for a, g in zip(accumulators, grads) if g is not None]
    targets = [accumulator.value for accumulator, _ in pairs]
    sources = [
        torch.as_tensor(grad, dtype=target.dtype, device=target.device)
        for (_, grad), target in zip(pairs, targets)
    ]
    torch._foreach_add_(targets, sources)


def sum_over_replicas(values):
    return values


@torch.no_grad()
def window_mean(totals, micro_steps):
    # In place: `totals` are the accumulators, which `end_window` zeroes
    # next. New tensors here cost 0.4 ms per window on the MLP (and page
    # faults), against 0.2 ms.
    if totals:
        torch._foreach_div_(totals, micro_steps)
    return totals


@torch.no_grad()
def end_window(optimizer):
    variables = optimizer._accumulators + [optimizer._micro_steps]
    torch._foreach_zero_([variable.value for variable in variables])


def run_if(optimizer, pred, fn):
    if bool(pred):
        fn()
