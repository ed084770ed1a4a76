"""Keras 3 optimizers that accumulate gradients over micro-batches.

`AdamAccumulate(accum_iters=k)` and the other `<Name>Accumulate` classes
update the weights once per `k` calls, with the mean of the `k` gradients,
exactly as their Keras parent would on a `k` times larger batch.
`accumulating(cls)` makes the same of any Keras optimizer class.
"""

from accum_optimizers.callbacks import AccumulationLogger
from accum_optimizers.callbacks import FlushAccumulation
from accum_optimizers.layers import AccumBatchNormalization
from accum_optimizers.optimizers import AdadeltaAccumulate
from accum_optimizers.optimizers import AdafactorAccumulate
from accum_optimizers.optimizers import AdagradAccumulate
from accum_optimizers.optimizers import AdamAccumulate
from accum_optimizers.optimizers import AdamaxAccumulate
from accum_optimizers.optimizers import AdamWAccumulate
from accum_optimizers.optimizers import FtrlAccumulate
from accum_optimizers.optimizers import LambAccumulate
from accum_optimizers.optimizers import LionAccumulate
from accum_optimizers.optimizers import MuonAccumulate
from accum_optimizers.optimizers import NadamAccumulate
from accum_optimizers.optimizers import RMSpropAccumulate
from accum_optimizers.optimizers import ScheduleFreeAdamWAccumulate
from accum_optimizers.optimizers import SGDAccumulate
from accum_optimizers.optimizers import accumulating

__version__ = "0.2.0.dev0"

__all__ = [
    "AccumBatchNormalization",
    "AccumulationLogger",
    "AdadeltaAccumulate",
    "AdafactorAccumulate",
    "AdagradAccumulate",
    "AdamAccumulate",
    "AdamWAccumulate",
    "AdamaxAccumulate",
    "FlushAccumulation",
    "FtrlAccumulate",
    "LambAccumulate",
    "LionAccumulate",
    "MuonAccumulate",
    "NadamAccumulate",
    "RMSpropAccumulate",
    "SGDAccumulate",
    "ScheduleFreeAdamWAccumulate",
    "accumulating",
]
