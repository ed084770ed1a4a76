"""Scaling rules: a learning rate that follows the window, for any
optimizer, without measuring anything.

With the window `S = window weight / base_batch_size` times a base batch,
each update uses `factor * learning_rate(tau)` and advances the
scale-invariant step `tau` by `S`: each update stands for `S` base steps,
so the base schedule runs on the base run's clock whatever the window.
The linear rule (Goyal et al., "Accurate, Large Minibatch SGD: Training
ImageNet in 1 Hour", 2017) takes `factor = S`, after a warm-up; the
square-root rule (Krizhevsky, "One weird trick for parallelizing
convolutional neural networks", 2014; Hoffer et al., "Train longer,
generalize better", 2017) takes `sqrt(S)`. AdaScale
(`_adascale_schedule.py`) is their adaptive sibling, for SGD.
"""

from __future__ import annotations

from typing import Any

from keras import ops
from keras.optimizers.schedules import LearningRateSchedule
from keras.saving import register_keras_serializable

from accum_optimizers._adascale_schedule import WindowScaledLearningRate
from accum_optimizers._validation import is_real_number
from accum_optimizers._validation import plain_number

_PACKAGE = "accum_optimizers"


def linear_scaling(
    learning_rate: float | LearningRateSchedule,
    base_batch_size: float,
    warmup_steps: float = 0,
) -> "LinearScalingLearningRate":
    """Scales `learning_rate` linearly with the window (Goyal et al. 2017).

    Pass it as the `learning_rate` of any accumulating optimizer. A window
    `S = window weight / base_batch_size` times the base batch updates at
    `factor * learning_rate(tau)` and advances the scale-invariant step
    `tau` by `S` (`optimizer.window_scale`,
    `optimizer.scale_invariant_step`), with

        factor = min(S, 1 + (S - 1) * min(1, tau / warmup_steps))

    (`S` where `warmup_steps=0`): the rate ramps from the base rate to `S`
    times it over the first `warmup_steps` base steps, `tau` read before
    the update. A window at or below the base batch (`S <= 1`) takes `S`.
    A window of weight 0 has `S = 0`: rate 0, and `tau` stays. Stop
    training when `tau` reaches the base schedule's end. A `MultiOptimizer`
    of several optimizers refuses it: `tau` is the model's clock.

    Args:
        learning_rate: the base run's learning rate: a float, or a
            `keras.optimizers.schedules.LearningRateSchedule` keyed on the
            base run's updates (it is called with `tau`, a float32).
        base_batch_size: Number > 0. The base run's batch, in the unit of
            the window's weight: its samples (or tokens) when windows are
            weighted (`weigh_micro_batches`, `apply(..., weight=n)`), its
            micro-batches (`1` for one) when they are not; unweighted
            under `tf.distribute`, replicas' shares of micro-batches (the
            number of replicas for one global micro-batch), and under
            torch `sync_windows` each rank's micro-batches.
        warmup_steps: Number >= 0. The base steps (of `tau`) over which
            the factor ramps from 1 to `S`; `0` for none.

    Returns:
        A `LinearScalingLearningRate`.
    """
    return LinearScalingLearningRate(
        learning_rate, base_batch_size, warmup_steps
    )


def sqrt_scaling(
    learning_rate: float | LearningRateSchedule, base_batch_size: float
) -> "SqrtScalingLearningRate":
    """Scales `learning_rate` by the square root of the window (Krizhevsky
    2014; Hoffer et al. 2017).

    Pass it as the `learning_rate` of any accumulating optimizer. A window
    `S = window weight / base_batch_size` times the base batch updates at
    `sqrt(S) * learning_rate(tau)` and advances the scale-invariant step
    `tau` by `S` (`optimizer.window_scale`,
    `optimizer.scale_invariant_step`). A window of weight 0 has `S = 0`:
    rate 0, and `tau` stays. A `MultiOptimizer` of several optimizers
    refuses it: `tau` is the model's clock.

    Args:
        learning_rate: the base run's learning rate: a float, or a
            `LearningRateSchedule` keyed on the base run's updates (it is
            called with `tau`, a float32).
        base_batch_size: Number > 0, in the unit of the window's weight
            (see `linear_scaling`).

    Returns:
        A `SqrtScalingLearningRate`.
    """
    return SqrtScalingLearningRate(learning_rate, base_batch_size)


@register_keras_serializable(package=_PACKAGE)
class LinearScalingLearningRate(WindowScaledLearningRate):
    """The linear scaling rule's learning rate (`linear_scaling`).

    Args:
        learning_rate: a float, or a `LearningRateSchedule`.
        base_batch_size: Number > 0.
        warmup_steps: Number >= 0, in base steps. Defaults to `0`.
    """

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule | dict[str, Any],
        base_batch_size: float,
        warmup_steps: float = 0,
    ) -> None:
        super().__init__(learning_rate, base_batch_size)
        if not is_real_number(warmup_steps) or not (
            0 <= warmup_steps < float("inf")
        ):
            raise ValueError(
                "`warmup_steps` must be a finite number >= 0 (base steps; "
                f"0 for none). Received: warmup_steps={warmup_steps!r}"
            )
        self.warmup_steps = plain_number(warmup_steps)

    def factor(self, scale_invariant_step: Any, steps: Any) -> Any:
        """`min(S, 1 + (S - 1) * min(1, tau / warmup_steps))`, `S` without
        a warm-up (`steps` is `S`)."""
        if not self.warmup_steps:
            return steps
        progress = ops.minimum(
            ops.divide(scale_invariant_step, float(self.warmup_steps)), 1.0
        )
        ramp = ops.add(1.0, ops.multiply(ops.subtract(steps, 1.0), progress))
        return ops.minimum(steps, ramp)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "warmup_steps": self.warmup_steps}

    def __repr__(self) -> str:
        return (
            f"linear_scaling({self.learning_rate!r}, "
            f"base_batch_size={self.base_batch_size!r}, "
            f"warmup_steps={self.warmup_steps!r})"
        )


@register_keras_serializable(package=_PACKAGE)
class SqrtScalingLearningRate(WindowScaledLearningRate):
    """The square-root scaling rule's learning rate (`sqrt_scaling`).

    Args:
        learning_rate: a float, or a `LearningRateSchedule`.
        base_batch_size: Number > 0.
    """

    def factor(self, scale_invariant_step: Any, steps: Any) -> Any:
        """`sqrt(S)` (`steps` is `S`)."""
        return ops.sqrt(steps)

    def __repr__(self) -> str:
        return (
            f"sqrt_scaling({self.learning_rate!r}, "
            f"base_batch_size={self.base_batch_size!r})"
        )
