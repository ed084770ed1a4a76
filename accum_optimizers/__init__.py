"""Keras 3 optimizers that accumulate gradients over micro-batches.

`AdamAccumulate(accum_iters=k)`, `SGDAccumulate` and `RMSpropAccumulate`
update the weights once per `k` calls, with the mean of the `k` gradients,
exactly as their Keras parent would on a `k` times larger batch.
"""

from accum_optimizers.adam import AdamAccumulate
from accum_optimizers.callbacks import AccumulationLogger
from accum_optimizers.callbacks import FlushAccumulation
from accum_optimizers.rmsprop import RMSpropAccumulate
from accum_optimizers.sgd import SGDAccumulate

__version__ = "0.1.0"

__all__ = [
    "AccumulationLogger",
    "AdamAccumulate",
    "FlushAccumulation",
    "RMSpropAccumulate",
    "SGDAccumulate",
]
