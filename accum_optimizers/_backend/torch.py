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


@torch.no_grad()
def add_into(optimizer, accumulators, grads):
    pairs = [(a, g) for a, g in zip(accumulators, grads) if g is not None]
    targets = [accumulator.value for accumulator, _ in pairs]
    sources = [
        torch.as_tensor(grad, dtype=target.dtype, device=target.device)
        for (_, grad), target in zip(pairs, targets)
    ]
    torch._foreach_add_(targets, sources)


def sum_over_replicas(variables):
    return [variable.value for variable in variables]


@torch.no_grad()
def end_window(optimizer):
    variables = optimizer._accumulators + [optimizer._micro_steps]
    torch._foreach_zero_([variable.value for variable in variables])


def run_if(optimizer, pred, fn):
    if bool(pred):
        fn()
