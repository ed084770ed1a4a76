"""Keras 3 optimizers that accumulate gradients over micro-batches.

`AdamAccumulate(accum_iters=k)` and the other `<Name>Accumulate` classes
update the weights once per `k` calls, with the mean of the `k` gradients,
exactly as their Keras parent would on a `k` times larger batch.
`accumulating(cls)` makes the same of any Keras optimizer class.
"""

import sys as _sys
from typing import Any as _Any

# `python -m accum_optimizers.demo` (and `.check`) imports this package
# first: quiet TensorFlow's start-up logs, and answer the demo's `--help`
# without importing Keras.
if _sys.orig_argv[1:3] == ["-m", "accum_optimizers.demo"]:
    from accum_optimizers import _demo_cli

    _demo_cli.before_keras(_sys.orig_argv[3:])
elif _sys.orig_argv[1:3] == ["-m", "accum_optimizers.check"]:
    from accum_optimizers import _demo_cli

    _demo_cli.quiet_tensorflow()

from accum_optimizers._keras_private import versions as _keras_versions  # noqa: E402

# Before anything else touches Keras: a clear error for an unsupported one.
_keras_versions.check_keras_version()

from accum_optimizers import optimizers as _optimizers  # noqa: E402
from accum_optimizers.callbacks import AccumulationLogger  # noqa: E402
from accum_optimizers.callbacks import FlushAccumulation  # noqa: E402
from accum_optimizers.check import check_exactness  # noqa: E402
from accum_optimizers.layers import AccumBatchNormalization  # noqa: E402
from accum_optimizers.memory_fit import MicroBatchPlan  # noqa: E402
from accum_optimizers.memory_fit import fit_to_memory  # noqa: E402
from accum_optimizers.memory_fit import plan_micro_batch  # noqa: E402
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
from accum_optimizers.optimizers import SGDAccumulate  # noqa: E402
from accum_optimizers.optimizers import accumulating  # noqa: E402
from accum_optimizers.saving import load_training_state  # noqa: E402
from accum_optimizers.weighting import weigh_micro_batches  # noqa: E402

# One class per optimizer the installed Keras ships: those above, and
# `ScheduleFreeAdamWAccumulate` (Keras >= 3.14) or any optimizer a newer Keras
# adds.
globals().update(_optimizers.OPTIMIZER_CLASSES)

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
    "MicroBatchPlan",
    "MuonAccumulate",
    "NadamAccumulate",
    "RMSpropAccumulate",
    "SGDAccumulate",
    "accumulating",
    "check_exactness",
    "fit_to_memory",
    "load_training_state",
    "plan_micro_batch",
    "weigh_micro_batches",
]
__all__ += sorted(set(_optimizers.OPTIMIZER_CLASSES) - set(__all__))


def __getattr__(name: str) -> _Any:
    # `accum_optimizers.ScheduleFreeAdamWAccumulate` on a Keras without
    # `ScheduleFreeAdamW`: say which Keras added it.
    if name in _optimizers.MISSING_OPTIMIZER_CLASSES:
        raise AttributeError(
            _keras_versions.missing_optimizer_message(
                _optimizers.MISSING_OPTIMIZER_CLASSES[name]
            )
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _MissingOptimizerFinder:
    """Gives `from accum_optimizers import ScheduleFreeAdamWAccumulate` the
    same message as the attribute, on a Keras without its parent.

    For a name a package lacks, `from package import name` first tries to
    import a submodule `package.name`, and reports its `ImportError` as it
    is (any `AttributeError` from `__getattr__` becomes a generic "cannot
    import name"). This finder, last on `sys.meta_path`, answers only for
    those missing names.
    """

    @staticmethod
    def find_spec(
        fullname: str, path: _Any = None, target: _Any = None
    ) -> None:
        package, _, name = fullname.rpartition(".")
        if (
            package == __name__
            and name in _optimizers.MISSING_OPTIMIZER_CLASSES
        ):
            raise ImportError(
                _keras_versions.missing_optimizer_message(
                    _optimizers.MISSING_OPTIMIZER_CLASSES[name]
                ),
                name=fullname,
            )
        return None


if _optimizers.MISSING_OPTIMIZER_CLASSES:
    _sys.meta_path.append(_MissingOptimizerFinder)
