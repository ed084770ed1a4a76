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
    targets = [accumulator.value for accumulator in accumulators]
    sources = [
        torch.as_tensor(grad, dtype=target.dtype, device=target.device)
        for grad, target in zip(grads, targets)
    ]
    torch._foreach_add_(targets, sources)


def sum_over_replicas(variables):
    return [variable.value for variable in variables]


@torch.no_grad()
def zero(variables):
    torch._foreach_zero_([variable.value for variable in variables])


def run_if(optimizer, pred, fn):
    if bool(pred):
        fn()
