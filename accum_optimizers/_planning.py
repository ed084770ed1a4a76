"""The micro-batch planned for a target batch: `plan_micro_batch` and the
`MicroBatchPlan` it returns (see `memory_fit` for what `fit_to_memory` does
with it)."""

from __future__ import annotations

import warnings
from typing import Any
from typing import Callable
from typing import Iterable
from typing import Sequence

import keras
import numpy as np
from keras import backend
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers import schedules
from accum_optimizers._backend import SUPPORTS_MEMORY_ANALYSIS
from accum_optimizers._backend import compiled_peak
from accum_optimizers._inner import accumulating_optimizers
from accum_optimizers._inner import refuse_accum_batch_norm_in_planning
from accum_optimizers._inner import unknown_optimizers_hint
from accum_optimizers._memory import format_bytes
from accum_optimizers._memory import memory_limit_bytes
from accum_optimizers._memory import probe
from accum_optimizers._micro_batches import arrays
from accum_optimizers._micro_batches import head
from accum_optimizers._micro_batches import sample_count
from accum_optimizers.weighting import weigh_micro_batches


class MicroBatchPlan:
    """What `plan_micro_batch` and `fit_to_memory` chose.

    Attributes:
        target_batch_size: the batch a window stands for.
        micro_batch_size: the micro-batch (a window's last one may be
            shorter). After `fit_to_memory`, the one training ended with.
        accum_iters: micro-batches per window, `ceil(target / micro)`.
        peak_bytes: the peak memory of the planned train step: XLA's memory
            analysis on JAX, the allocator's peak over the step on a GPU
            (TensorFlow, torch); `None` where neither is available (the
            CPU, without JAX).
        memory_limit: the limit planned against, in bytes, or `None`.
        method: how the micro-batch was chosen: `"memory_analysis"`,
            `"out_of_memory_probes"` or `"given"`.
        probes: `(micro_batch_size, fits, peak_bytes)` for each candidate
            tried, in order.
        recoveries: `(epoch, sample, micro_batch_size, new_size)` for each
            out-of-memory error `fit_to_memory` recovered from: the epoch,
            the first sample of the failed micro-batch in the epoch's
            order, and the sizes before and after.
    """

    def __init__(
        self,
        target_batch_size: int,
        micro_batch_size: int,
        peak_bytes: int | None = None,
        memory_limit: int | None = None,
        method: str = "given",
        probes: Iterable[tuple[int, bool, int | None]] = (),
    ) -> None:
        self.target_batch_size = target_batch_size
        self.micro_batch_size = micro_batch_size
        self.peak_bytes = peak_bytes
        self.memory_limit = memory_limit
        self.method = method
        self.probes = list(probes)
        self.recoveries: list[tuple[int, int, int, int]] = []

    @property
    def accum_iters(self) -> int:
        """Micro-batches per window, `ceil(target / micro)`."""
        return -(-self.target_batch_size // self.micro_batch_size)

    def __repr__(self) -> str:
        peak = (
            "unknown"
            if self.peak_bytes is None
            else format_bytes(self.peak_bytes)
        )
        text = (
            f"micro-batch {self.micro_batch_size} x accum_iters "
            f"{self.accum_iters} for target batch {self.target_batch_size} "
            f"(peak {peak}"
        )
        if self.memory_limit is not None:
            text += f" of limit {format_bytes(self.memory_limit)}"
        text += f"; {self.method})"
        if self.recoveries:
            text += f", {len(self.recoveries)} out-of-memory recoveries"
        return f"MicroBatchPlan({text})"


def plan_micro_batch(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    target_batch_size: int,
    sample_weight: Any = None,
    memory_limit: int | str | None = None,
    micro_batch_size: int | None = None,
) -> MicroBatchPlan:
    """Finds the largest micro-batch whose train step fits in memory.

    Sets `accum_iters` of the model's accumulating optimizer(s) to
    `ceil(target_batch_size / micro_batch_size)` and makes `model.fit`
    weigh its micro-batches (`weigh_micro_batches`). The model's weights
    and state are as they were.

    Args:
        model: a compiled `keras.Model` whose optimizer accumulates (an
            `accum_optimizers` class, possibly in a `LossScaleOptimizer`),
            with an integer `accum_iters` and no pending window.
        x: the inputs: a numpy array or a list, tuple or dict of them (or
            backend tensors, which are copied to numpy). Its first
            `micro_batch_size` samples are the probes' batch.
        y: the targets, structured like `x`, or `None`.
        target_batch_size: Integer >= 1, the batch size the training
            stands for.
        sample_weight: Optional array of per-sample weights.
        memory_limit: Optional number of bytes (an int, or a string such as
            `"12GiB"` or `"500MB"`): plan against this limit from the
            compiled train step's memory analysis, without running it.
            JAX only (TensorFlow and torch report no memory of a step they
            have not run). Defaults to `None`: probe with real train steps
            and the backend's out-of-memory error.
        micro_batch_size: Optional integer in `[1, target_batch_size]`:
            use this micro-batch without searching. Defaults to `None`.

    Returns:
        A `MicroBatchPlan`.

    Raises:
        TypeError: if `model` is not a `keras.Model`, or a size is not an
            integer.
        ValueError: an argument that cannot be planned with (a model
            whose optimizer does not accumulate, or holds a pending window;
            `memory_limit` off JAX), named with its value.
        MemoryError: if not even a micro-batch of 1 sample fits.
    """
    target = positive_int("target_batch_size", target_batch_size)
    limit = memory_limit_bytes(memory_limit)
    if micro_batch_size is not None:
        micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
        if micro_batch_size > target:
            raise ValueError(
                "`micro_batch_size` must be at most `target_batch_size`. "
                f"Received: micro_batch_size={micro_batch_size}, "
                f"target_batch_size={target}"
            )
    if limit is not None and not SUPPORTS_MEMORY_ANALYSIS:
        raise ValueError(
            "`memory_limit` plans from the compiled train step's memory "
            "analysis, which only JAX offers without running the step. On "
            f"the {backend.backend()} backend pass memory_limit=None to "
            "probe with real train steps. Received: "
            f"memory_limit={memory_limit!r}"
        )
    optimizers = _prepared_optimizers(model)
    data = arrays(x, y, sample_weight)
    count = sample_count(data)
    _build(model, optimizers, data)
    weigh_micro_batches(model)
    if micro_batch_size is not None:
        set_window(model, optimizers, target, micro_batch_size)
        # `None` where the backend has no memory analysis (`_backend/`).
        peak = compiled_peak(model, head(data, micro_batch_size))
        return MicroBatchPlan(target, micro_batch_size, peak, limit)

    fits: Callable[[int], tuple[bool, int | None]]
    if limit is not None:

        def fits(size: int) -> tuple[bool, int | None]:
            set_window(model, optimizers, target, size)
            peak = compiled_peak(model, head(data, size))
            return peak <= limit, peak

        method = "memory_analysis"
    else:

        def fits(size: int) -> tuple[bool, int | None]:
            set_window(model, optimizers, target, size)
            return probe(model, optimizers, head(data, min(size, count)))

        method = "out_of_memory_probes"
    probes: list[tuple[int, bool, int | None]] = []
    tried: dict[int, tuple[bool, int | None]] = {}

    def try_size(size: int) -> bool:
        if size not in tried:
            tried[size] = fits(size)
            probes.append((size, *tried[size]))
        return tried[size][0]

    # The window sizes `k`, each with its smallest micro-batch
    # `ceil(target / k)`: doubling `k` until one fits, then bisecting
    # between the last `k` that did not and the first that did.
    windows = 1
    while not try_size(-(-target // windows)):
        if windows >= target:
            set_window(model, optimizers, target, target)
            raise MemoryError(
                "plan_micro_batch: not even a micro-batch of 1 sample fits "
                + (
                    f"memory_limit={limit} bytes (its step's peak is "
                    f"{tried[1][1]} bytes)"
                    if limit is not None
                    else "in the device's memory"
                )
                + f". Received: target_batch_size={target}"
            )
        windows = min(2 * windows, target)
    fitting, failing = windows, windows // 2
    while fitting - failing > 1:
        middle = (fitting + failing) // 2
        if try_size(-(-target // middle)):
            fitting = middle
        else:
            failing = middle
    size = -(-target // fitting)
    set_window(model, optimizers, target, size)
    return MicroBatchPlan(target, size, tried[size][1], limit, method, probes)


# -- Checks -----------------------------------------------------------------


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
        )
    if value < 1:
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
        )
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < 0
    ):
        raise ValueError(
            f"`{name}` must be an integer >= 0. Received: {name}={value!r}"
        )
    return int(value)


def _prepared_optimizers(model: keras.Model) -> list[Any]:
    """The model's accumulating optimizers, checked for a plan to set."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a `keras.Model`. Received: model={model!r}"
        )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError("fit_to_memory: compile the model first.")
    refuse_accum_batch_norm_in_planning(model)
    optimizers = accumulating_optimizers(optimizer)
    if not optimizers or len(optimizers) != _inner_count(optimizer):
        raise ValueError(
            "fit_to_memory needs an accumulating optimizer (an "
            "`accum_optimizers` class or `accumulating(cls)`, possibly in a "
            "`LossScaleOptimizer`): it sets `accum_iters`."
            f"{unknown_optimizers_hint(optimizer)} Received: "
            f"optimizer={optimizer!r}"
        )
    for inner_optimizer in optimizers:
        accum_iters = inner_optimizer.accum_iters
        if isinstance(accum_iters, (dict, schedules.AccumSchedule)):
            raise ValueError(
                "fit_to_memory sets `accum_iters` from the target batch; a "
                "schedule of it has no single window size to set. Compile "
                "with an integer `accum_iters`. Received: "
                f"accum_iters={accum_iters!r}"
            )
        if inner_optimizer.built and not inner_optimizer._has_window:
            raise ValueError(
                "fit_to_memory needs the optimizer's window state, which an "
                "optimizer built with accum_iters=1 lacks. Compile with a "
                "new (unbuilt) optimizer or with accum_iters > 1. Received: "
                f"{inner_optimizer.name} built with accum_iters=1"
            )
        if inner_optimizer.built:
            pending = int(ops.convert_to_numpy(inner_optimizer.micro_steps))
            if pending:
                raise ValueError(
                    "fit_to_memory starts with no window pending; "
                    f"{inner_optimizer.name} holds {pending} micro-batches. "
                    "Call `optimizer.flush()` first. Received: "
                    f"micro_steps={pending}"
                )
    return optimizers


def _inner_count(optimizer: keras.optimizers.Optimizer) -> int:
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return len(getattr(optimizer, "optimizers", [optimizer]))


# -- The window -----------------------------------------------------------


def _build(model: keras.Model, optimizers: Sequence[Any], data: Any) -> None:
    """Builds the model, its metrics and the optimizer (with its window
    state: built at `accum_iters >= 2`), as `fit` would on `data`."""
    for optimizer in optimizers:
        if not optimizer.built:
            optimizer.accum_iters = max(2, optimizer.accum_iters)
    _keras_private.symbolic_build(model, head(data, 1))
    for optimizer in optimizers:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)


def set_window(
    model: keras.Model, optimizers: Sequence[Any], target: int, size: int
) -> None:
    """`accum_iters` for micro-batches of `size`; the train function, which
    reads it as a constant, is traced again."""
    with warnings.catch_warnings():
        # (The setter warns of the compiled train function, traced again
        # here.)
        warnings.simplefilter("ignore")
        for optimizer in optimizers:
            optimizer.accum_iters = -(-target // size)
    model.train_function = None
