"""Accumulation schedules keyed on the measured gradient noise scale
(`by_noise_scale`); see `_window/noise.py` for the measurement."""

from __future__ import annotations

from typing import Any

from keras import ops
from keras.saving import register_keras_serializable

from accum_optimizers._schedule_base import AccumSchedule
from accum_optimizers._validation import is_integer
from accum_optimizers._validation import is_real_number
from accum_optimizers._validation import plain_number
from accum_optimizers._validation import validate_positive_ints

_PACKAGE = "accum_optimizers"


def by_noise_scale(
    micro_batch_size: float,
    floor: int = 2,
    ceiling: int = 64,
    grow_only: bool = True,
    warmup_windows: int = 20,
) -> NoiseScaleAccumIters:
    """An accumulation schedule that follows the measured noise scale.

    The window holds `ceil(noise_scale / micro_batch_size)` micro-batches,
    clipped to `[floor, ceiling]` (`floor` before the first estimate): the
    big batch follows `B_simple` (McCandlish et al., 2018), which the
    optimizer measures (`measure_noise_scale=True`) and which changes only
    when a window closes. Deterministic given the data order and seeds.

    Args:
        micro_batch_size: Number > 0. The weight of one micro-batch in the
            unit the noise scale is counted in: its samples (or tokens)
            when windows are weighted (`weigh_micro_batches`,
            `apply(..., weight=n)`); `1` when they are not (the noise
            scale is then counted in micro-batches).
        floor: Integer >= 2. The smallest window: a window of one
            micro-batch measures nothing, and would stay at one. Defaults
            to `2`.
        ceiling: Integer >= `floor`. The largest window. Defaults to `64`.
        grow_only: Boolean. Follow the largest noise scale measured so
            far, so that the window never shrinks (the noise scale grows
            as the loss falls). Defaults to `True`.
        warmup_windows: Integer >= 0. Hold `floor` until the averages
            hold this many windows' estimates (their total weight reaches
            `1 - noise_scale_momentum**warmup_windows`): one window's
            estimate is noisy, and a grow-only window would keep its
            largest fluke. Defaults to `20`.

    Returns:
        A `NoiseScaleAccumIters`, for `accum_iters`.

    Raises:
        TypeError: if `grow_only` is not a bool.
        ValueError: if another argument is out of its range, named with
            its value.
    """
    return NoiseScaleAccumIters(
        micro_batch_size, floor, ceiling, grow_only, warmup_windows
    )


def keyed_on_noise_scale(schedule: Any) -> bool:
    """Whether a schedule is keyed on the measured noise scale.

    Args:
        schedule: anything `accum_iters` takes.

    Returns:
        A bool.
    """
    return isinstance(schedule, NoiseScaleAccumIters)


@register_keras_serializable(package=_PACKAGE)
class NoiseScaleAccumIters(AccumSchedule):
    """The window size as a function of the noise scale (`by_noise_scale`).

    Called with the noise scale (a float32 scalar, NaN before the first
    estimate, infinite where the gradient is lost in its noise), returns
    `clip(ceil(noise_scale / micro_batch_size), floor, ceiling)` (`floor`
    for NaN).

    Args:
        micro_batch_size: Number > 0, see `by_noise_scale`.
        floor: Integer >= 2. The smallest window.
        ceiling: Integer >= `floor`. The largest window.
        grow_only: Boolean. Keyed on the largest noise scale measured.
        warmup_windows: Integer >= 0, see `by_noise_scale`.
    """

    def __init__(
        self,
        micro_batch_size: float,
        floor: int = 2,
        ceiling: int = 64,
        grow_only: bool = True,
        warmup_windows: int = 20,
    ) -> None:
        if not is_real_number(micro_batch_size) or not (
            0 < micro_batch_size < float("inf")
        ):
            raise ValueError(
                "`micro_batch_size` must be a finite number > 0. Received: "
                f"micro_batch_size={micro_batch_size!r}"
            )
        validate_positive_ints(floor=floor, ceiling=ceiling)
        if floor < 2:
            raise ValueError(
                "`floor` must be >= 2: a window of one micro-batch measures "
                f"no noise scale. Received: floor={floor!r}"
            )
        if ceiling < floor:
            raise ValueError(
                "`ceiling` must be >= `floor`. Received: "
                f"floor={floor!r}, ceiling={ceiling!r}"
            )
        if not isinstance(grow_only, bool):
            raise TypeError(
                f"`grow_only` must be a bool. Received: grow_only={grow_only!r}"
            )
        if not is_integer(warmup_windows) or warmup_windows < 0:
            raise ValueError(
                "`warmup_windows` must be an integer >= 0. Received: "
                f"warmup_windows={warmup_windows!r}"
            )
        self.warmup_windows = int(warmup_windows)
        self.micro_batch_size = plain_number(micro_batch_size)
        self.floor, self.ceiling = int(floor), int(ceiling)
        self.grow_only = grow_only
        self.min_accum_iters = self.floor

    def __call__(self, noise_scale: Any) -> Any:
        noise_scale = ops.cast(noise_scale, "float32")
        windows = ops.divide(noise_scale, float(self.micro_batch_size))
        windows = ops.where(ops.isnan(windows), float(self.floor), windows)
        windows = ops.clip(windows, float(self.floor), float(self.ceiling))
        return ops.cast(ops.ceil(windows), "int32")

    def get_config(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "floor": self.floor,
            "ceiling": self.ceiling,
            "grow_only": self.grow_only,
            "warmup_windows": self.warmup_windows,
        }
