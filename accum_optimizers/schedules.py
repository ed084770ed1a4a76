"""Accumulation schedules: the window size as a function of applied updates
(or, with `by_samples`, of the samples seen).

`accum_iters` takes an integer, a dict `{update: k}`, or an `AccumSchedule`.
The window that produces update `t` (counting from 0) averages `k(t)`
micro-batches, so a run at micro-batch `b` trains exactly like the parent
optimizer on batches of `k(t) * b`: a batch-size ramp.

```python
# Batch 32 for 1000 updates, then 64, then 128 (micro-batches of 32):
optimizer = AdamAccumulate(accum_iters={0: 1, 1000: 2, 5000: 4})
# From 1 to 8 micro-batches over the first 2000 updates:
optimizer = AdamAccumulate(accum_iters=LinearRamp(1, 8, ramp_updates=2000))
# Keyed on samples: 1 micro-batch until 1M samples were applied, then 4,
# with a learning-rate warm-up over the first 100k samples:
optimizer = AdamAccumulate(
    accum_iters=by_samples({0: 1, 1_000_000: 4}),
    learning_rate=by_samples(warm_up_schedule),
)
```
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops
from keras.optimizers.schedules import LearningRateSchedule
from keras.saving import register_keras_serializable

from accum_optimizers._schedule_base import AccumSchedule
from accum_optimizers._validation import validate_accum_iters
from accum_optimizers._validation import validate_boundaries
from accum_optimizers._validation import validate_positive_ints

_PACKAGE = "accum_optimizers"


def get(
    identifier: int | dict[int, int] | AccumSchedule,
) -> int | AccumSchedule:
    """The window size `accum_iters` names: an `int`, or an `AccumSchedule`.

    Args:
        identifier: an integer >= 1, a dict `{update: k}` (a dict with the
            single key `0` is the constant it holds), or an `AccumSchedule`.

    Returns:
        The integer, or the schedule (a dict becomes a
        `PiecewiseConstantAccumIters`).

    Raises:
        TypeError: if `identifier` is none of these.
        ValueError: if it is an integer below 1, or a dict whose first key
            is not `0` or whose values are not integers >= 1.
    """
    if isinstance(identifier, AccumSchedule):
        return identifier
    if isinstance(identifier, dict):
        boundaries = validate_boundaries(identifier)
        if len(boundaries) == 1:
            return boundaries[0]
        return PiecewiseConstantAccumIters(boundaries)
    try:
        return validate_accum_iters(identifier)
    except TypeError:
        raise TypeError(
            "`accum_iters` must be an integer >= 1, a dict `{update: k}` "
            f"or an `AccumSchedule`. Received: accum_iters={identifier!r} "
            f"(of type {type(identifier).__name__})"
        ) from None


@register_keras_serializable(package=_PACKAGE)
class PiecewiseConstantAccumIters(AccumSchedule):
    """`k` changes at given update counts: what a dict `accum_iters` means.

    Args:
        boundaries: dict `{update: k}`; keys are applied-update counts, the
            first is `0`; values are integers `>= 1`.
    """

    def __init__(self, boundaries: dict[int, int]) -> None:
        self.boundaries = validate_boundaries(boundaries)
        self.min_accum_iters = min(self.boundaries.values())

    def __call__(self, update: Any) -> Any:
        update = _count(update)
        window = ops.convert_to_tensor(self.boundaries[0], "int32")
        for start, size in sorted(self.boundaries.items())[1:]:
            window = ops.where(
                ops.greater_equal(update, start),
                ops.convert_to_tensor(size, "int32"),
                window,
            )
        return window

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": dict(self.boundaries)}


@register_keras_serializable(package=_PACKAGE)
class LinearRamp(AccumSchedule):
    """`k` grows linearly from `initial` to `final` over `ramp_updates`.

    `k(t) = initial + floor((final - initial) * min(t, ramp_updates) /
    ramp_updates)`: the effective batch grows with the updates applied,
    then stays at `final`.

    Args:
        initial: Integer >= 1. The window size at update 0.
        final: Integer >= 1. The window size from `ramp_updates` on.
        ramp_updates: Integer >= 1. Updates over which `k` ramps.
    """

    def __init__(self, initial: int, final: int, ramp_updates: int) -> None:
        validate_positive_ints(
            initial=initial, final=final, ramp_updates=ramp_updates
        )
        self.initial, self.final = int(initial), int(final)
        self.ramp_updates = int(ramp_updates)
        self.min_accum_iters = min(self.initial, self.final)

    def __call__(self, update: Any) -> Any:
        update = _count(update)
        if _dtype(update) == "float32":
            # Samples seen (`by_samples`): past int32's range, and a ramp
            # over millions of them would overflow an int32 product.
            progress = ops.minimum(update, float(self.ramp_updates))
            growth = ops.floor(
                progress * (self.final - self.initial) / self.ramp_updates
            )
        else:
            progress = ops.minimum(update, self.ramp_updates)
            growth = ops.floor_divide(
                ops.multiply(progress, self.final - self.initial),
                self.ramp_updates,
            )
        return ops.add(ops.cast(growth, "int32"), self.initial)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial": self.initial,
            "final": self.final,
            "ramp_updates": self.ramp_updates,
        }


def by_samples(
    schedule: AccumSchedule | dict[int, int] | LearningRateSchedule,
) -> SamplesAccumSchedule | SamplesLearningRateSchedule:
    """Keys `schedule` on the samples seen instead of the applied updates.

    The optimizer counts the total weight of the windows it applied
    (`optimizer.samples_seen`): samples, or valid tokens or sample weights,
    when windows are weighted (`weigh_micro_batches(model)` in `fit`,
    `apply(..., weight=n)` in a custom loop); micro-batches, each weighing
    1, otherwise. A schedule keyed on it stays defined per sample when the
    batch grows: the update after `s` samples uses `schedule(s)`, as the
    parent optimizer fed the same big batches would with its learning rate
    set at the same sample counts.

    Args:
        schedule: an `AccumSchedule` or a dict `{samples: k}` (for
            `accum_iters`), or a `keras.optimizers.schedules
            .LearningRateSchedule` (for `learning_rate`).

    Returns:
        A `SamplesAccumSchedule` or a `SamplesLearningRateSchedule`, which
        only accumulating optimizers accept.

    Raises:
        TypeError: if `schedule` is none of these.
    """
    if isinstance(schedule, LearningRateSchedule):
        return SamplesLearningRateSchedule(schedule)
    if isinstance(schedule, (dict, AccumSchedule)):
        return SamplesAccumSchedule(schedule)
    raise TypeError(
        "`schedule` must be an `AccumSchedule`, a dict `{samples: k}` or a "
        "`LearningRateSchedule`. Received: "
        f"schedule={schedule!r} of type {type(schedule).__name__}"
    )


def keyed_on_samples(schedule: Any) -> bool:
    """Whether a schedule is keyed on the samples seen (`by_samples`).

    Args:
        schedule: anything `accum_iters` or `learning_rate` takes.

    Returns:
        A bool.
    """
    return isinstance(
        schedule, (SamplesAccumSchedule, SamplesLearningRateSchedule)
    )


class _KeyedOnSamples:
    """Saving and printing of a schedule wrapped by `by_samples` (its
    `schedule`)."""

    schedule: Any

    def get_config(self) -> dict[str, Any]:
        return {"schedule": keras.saving.serialize_keras_object(self.schedule)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        schedule = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(schedule)  # type: ignore[call-arg]

    def __repr__(self) -> str:
        return f"by_samples({self.schedule!r})"


@register_keras_serializable(package=_PACKAGE)
class SamplesAccumSchedule(_KeyedOnSamples, AccumSchedule):
    """An accumulation schedule keyed on the samples seen (`by_samples`).

    Args:
        schedule: an `AccumSchedule`, or a dict `{samples: k}`, whose key
            is the samples seen (a float32 scalar) instead of updates.
    """

    def __init__(self, schedule: AccumSchedule | dict[int, int]) -> None:
        if isinstance(schedule, dict):
            schedule = PiecewiseConstantAccumIters(schedule)
        if not isinstance(schedule, AccumSchedule) or isinstance(
            schedule, SamplesAccumSchedule
        ):
            raise TypeError(
                "`schedule` must be an `AccumSchedule` or a dict "
                f"`{{samples: k}}`. Received: schedule={schedule!r}"
            )
        self.schedule = schedule
        self.min_accum_iters = schedule.min_accum_iters

    def __call__(self, samples: Any) -> Any:
        return self.schedule(samples)


@register_keras_serializable(package=_PACKAGE)
class SamplesLearningRateSchedule(_KeyedOnSamples, LearningRateSchedule):
    """A learning-rate schedule keyed on the samples seen (`by_samples`).

    An accumulating optimizer evaluates `schedule` at its `samples_seen`;
    any other optimizer would call it with its update count, so calling it
    raises.

    Args:
        schedule: a `LearningRateSchedule`.
    """

    def __init__(self, schedule: LearningRateSchedule) -> None:
        if not isinstance(schedule, LearningRateSchedule) or isinstance(
            schedule, SamplesLearningRateSchedule
        ):
            raise TypeError(
                "`schedule` must be a `keras.optimizers.schedules."
                f"LearningRateSchedule`. Received: schedule={schedule!r}"
            )
        self.schedule = schedule

    def __call__(self, step: Any) -> Any:
        """Refuses: only an accumulating optimizer evaluates it.

        Raises:
            TypeError: always; pass it to an accumulating optimizer.
        """
        raise TypeError(
            f"by_samples({type(self.schedule).__name__}) is keyed on the "
            "samples an accumulating optimizer counts; pass it as the "
            "`learning_rate` of an `accum_optimizers` optimizer (with any "
            "`accum_iters`), not of a plain Keras optimizer."
        )

    def at_samples(self, samples: Any) -> Any:
        """The learning rate after a number of samples.

        Args:
            samples: the samples seen, a float32 scalar.

        Returns:
            `schedule(samples)`.
        """
        return self.schedule(samples)


def _count(update: Any) -> Any:
    """An update count as int32, or samples seen as float32."""
    if not hasattr(update, "dtype") and isinstance(update, float):
        return ops.convert_to_tensor(update, "float32")
    if hasattr(update, "dtype") and "float" in _dtype(update):
        return ops.cast(update, "float32")
    return ops.cast(update, "int32")


def _dtype(value: Any) -> str:
    return keras.backend.standardize_dtype(value.dtype)


# Keyed on the measured noise scale (a module of its own, which subclasses
# `AccumSchedule` above), AdaScale's learning rate and the scaling rules.
from accum_optimizers._adascale_schedule import AdaScaleLearningRate  # noqa: E402, F401
from accum_optimizers._adascale_schedule import adascale  # noqa: E402, F401
from accum_optimizers._noise_schedule import NoiseScaleAccumIters  # noqa: E402, F401
from accum_optimizers._noise_schedule import by_noise_scale  # noqa: E402, F401
from accum_optimizers._noise_schedule import keyed_on_noise_scale  # noqa: E402, F401
from accum_optimizers._scaling_rules import LinearScalingLearningRate  # noqa: E402, F401
from accum_optimizers._scaling_rules import SqrtScalingLearningRate  # noqa: E402, F401
from accum_optimizers._scaling_rules import linear_scaling  # noqa: E402, F401
from accum_optimizers._scaling_rules import sqrt_scaling  # noqa: E402, F401
