"""Keras 3 optimizers that accumulate gradients over micro-batches.

`AdamAccumulate(accum_iters=k)` and the other `<Name>Accumulate` classes
update the weights once per `k` calls, with the mean of the `k` gradients,
exactly as their Keras parent would on a `k` times larger batch.
`accumulating(cls)` makes the same of any Keras optimizer class.
"""

import os as _os
import sys as _sys

# `python -m accum_optimizers.demo` imports this package, and so TensorFlow,
# before the demo's first line: quiet TensorFlow's C++ start-up logs here,
# for the demo only (a user's own process keeps its settings).
if _sys.orig_argv[1:3] == ["-m", "accum_optimizers.demo"]:
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from accum_optimizers.callbacks import AccumulationLogger  # noqa: E402
from accum_optimizers.callbacks import FlushAccumulation  # noqa: E402
from accum_optimizers.layers import AccumBatchNormalization  # noqa: E402
from accum_optimizers.optimizers import AdadeltaAccumulate  # noqa: E402
from accum_optimizers.optimizers import AdafactorAccumulate  # noqa: E402
from accum_optimizers.optimizers import AdagradAccumulate  # noqa: E402
from accum_optimizers.optimizers import AdamAccumulate  # noqa: E402
from accum_optimizers.optimizers import AdamaxAccumulate  # noqa: E402
from accum_optimizers.optimizers import AdamWAccumulate  # noqa: E402
from accum_optimizers.optimizers import FtrlAccumulate  # noqa: E402
from accum_optimizers.optimizers import LambAccumulate  # noqa: E402
from accum_optimizers.optimizers import LionAccumulate  # noqa: E402
from accum_optimizers.optimizers import MuonAccumulate  # noqa: E402
from accum_optimizers.optimizers import NadamAccumulate  # noqa: E402
from accum_optimizers.optimizers import RMSpropAccumulate  # noqa: E402
from accum_optimizers.optimizers import ScheduleFreeAdamWAccumulate  # noqa: E402
from accum_optimizers.optimizers import SGDAccumulate  # noqa: E402
from accum_optimizers.optimizers import accumulating  # noqa: E402
from accum_optimizers.weighting import weigh_micro_batches  # noqa: E402

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
    "weigh_micro_batches",
]
