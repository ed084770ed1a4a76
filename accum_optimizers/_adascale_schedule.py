"""AdaScale: a learning rate that scales with the window (Johnson et al.,
"AdaScale SGD: A User-Friendly Algorithm for Distributed Training", ICML
2020), from the gradient noise scale the window measures.

With the window `S` times a base batch of `b` samples, the gain

    r = (tr(Sigma) / b + |G|^2) / (tr(Sigma) / (S b) + |G|^2)

lies in `[1, S]`: `S` where the noise dominates (a batch `S` times
bigger is worth `S` steps), `1` where the gradient does. Each update uses
`r` times the base learning rate at the scale-invariant step `tau`, and
advances `tau` by `r`: each update stands for `r` base steps, so while the
noise dominates (`r` near `S`) a run at scale `S` follows the base run per
sample with `S` times fewer updates. `_window/adascale.py` computes `r` at
each window's close.

`WindowScaledLearningRate`, its base class, is also the scaling rules'
(`_scaling_rules.py`), which take `S` where AdaScale takes `r`.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops
from keras.optimizers.schedules import LearningRateSchedule
from keras.saving import register_keras_serializable

from accum_optimizers._validation import is_real_number
from accum_optimizers._validation import plain_number

_PACKAGE = "accum_optimizers"


def adascale(
    learning_rate: float | LearningRateSchedule, base_batch_size: float
) -> AdaScaleLearningRate:
    """Scales `learning_rate` with the window, by AdaScale's gain.

    Pass it as the `learning_rate` of `SGDAccumulate(...,
    measure_noise_scale=True)`. Each update uses `r * learning_rate(tau)`,
    with `r` in `[1, S]` the gain of a window `S = window weight /
    base_batch_size` times the base batch (from the noise scale's moving
    averages, `1` before the first estimate, `0` for a window of weight 0)
    and `tau` the scale-invariant step, which advances by `r` per update
    (`optimizer.adascale_gain`, `optimizer.scale_invariant_step`). Stop
    training when `tau` reaches the base schedule's end. A state saved
    without AdaScale resumes with `tau` = its updates. A `MultiOptimizer`
    of several optimizers refuses it: its gain is the whole model's.

    Args:
        learning_rate: the base run's learning rate: a float, or a
            `keras.optimizers.schedules.LearningRateSchedule` keyed on the
            base run's updates (it is called with `tau`, a float32).
        base_batch_size: Number > 0. The base run's batch, in the noise
            scale's unit: its samples (or tokens) when windows are
            weighted (`weigh_micro_batches`, `apply(..., weight=n)`), its
            micro-batches (`1` for one) when they are not; unweighted
            under `tf.distribute`, replicas' shares of micro-batches (the
            number of replicas for one global micro-batch), and under
            torch `sync_windows` each rank's micro-batches.

    Returns:
        An `AdaScaleLearningRate`.

    Raises:
        TypeError: if `learning_rate` is itself AdaScale's or keyed on
            samples (`by_samples`).
        ValueError: if `learning_rate` or `base_batch_size` is not a
            finite number in its range.
    """
    return AdaScaleLearningRate(learning_rate, base_batch_size)


def is_adascale(learning_rate: Any) -> bool:
    """Whether `learning_rate` (an optimizer's) is an AdaScale one."""
    return isinstance(learning_rate, AdaScaleLearningRate)


def follows_window(learning_rate: Any) -> bool:
    """Whether `learning_rate` (an optimizer's) is scaled per window:
    AdaScale's, or a scaling rule's (`linear_scaling`, `sqrt_scaling`)."""
    return isinstance(learning_rate, WindowScaledLearningRate)


class WindowScaledLearningRate(LearningRateSchedule):
    """A base learning rate scaled per window, on the base run's clock.

    An accumulating optimizer evaluates it `at(tau, steps)`: `tau` the
    scale-invariant step (the base steps its updates stood for), `steps`
    the base steps the update being applied stands for (`base_steps`).
    Any other optimizer would call it with its update count, so calling it
    raises.

    Args:
        learning_rate: a float, or a `LearningRateSchedule` keyed on the
            base run's updates.
        base_batch_size: Number > 0, see `adascale`.
    """

    # What the optimizer needs besides (for the error of a plain call).
    _needs = ""

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule | dict[str, Any],
        base_batch_size: float,
    ) -> None:
        if isinstance(learning_rate, dict):
            learning_rate = keras.saving.deserialize_keras_object(learning_rate)
        # (A `by_samples` schedule is evaluated `at_samples`.)
        if isinstance(learning_rate, WindowScaledLearningRate) or hasattr(
            learning_rate, "at_samples"
        ):
            raise TypeError(
                "`learning_rate` must be a float or a `keras.optimizers."
                "schedules.LearningRateSchedule` keyed on updates: it is "
                "called with the scale-invariant step, in the base run's "
                f"updates. Received: learning_rate={learning_rate!r}"
            )
        if not isinstance(learning_rate, LearningRateSchedule):
            if not is_real_number(learning_rate) or not (
                0 <= learning_rate < float("inf")
            ):
                raise ValueError(
                    "`learning_rate` must be a finite number >= 0 or a "
                    "`LearningRateSchedule`. Received: "
                    f"learning_rate={learning_rate!r}"
                )
            learning_rate = plain_number(learning_rate)
        if not is_real_number(base_batch_size) or not (
            0 < base_batch_size < float("inf")
        ):
            raise ValueError(
                "`base_batch_size` must be a finite number > 0. Received: "
                f"base_batch_size={base_batch_size!r}"
            )
        self.learning_rate = learning_rate
        self.base_batch_size = plain_number(base_batch_size)

    def __call__(self, step: Any) -> Any:
        """Refuses: only an accumulating optimizer evaluates it.

        Raises:
            TypeError: always; pass it to an accumulating optimizer with
                `measure_noise_scale=True`.
        """
        raise TypeError(
            f"{self!r} scales the learning rate by an accumulating "
            "optimizer's window; pass it as the `learning_rate` of an "
            f"`accum_optimizers` optimizer{self._needs}, not of a plain "
            "Keras optimizer."
        )

    def base_steps(self, window_weight: Any) -> Any:
        """The base steps an update of a window of `window_weight` (float32,
        the noise scale's unit) stands for: a scaling rule's `S =
        window_weight / base_batch_size` (AdaScale's gain is computed at
        the close, `_window/adascale.py`)."""
        return ops.divide(window_weight, float(self.base_batch_size))

    def factor(self, scale_invariant_step: Any, steps: Any) -> Any:
        """What the base rate is multiplied by, for an update standing for
        `steps` base steps at `scale_invariant_step` (float32 scalars)."""
        raise NotImplementedError

    def at(self, scale_invariant_step: Any, steps: Any) -> Any:
        """The learning rate of an update.

        Args:
            scale_invariant_step: `tau`, a float32 scalar.
            steps: the base steps the update stands for (AdaScale's gain
                `r`, a scaling rule's `S`), a float32 scalar.

        Returns:
            `factor` times the base learning rate at
            `scale_invariant_step`, a float32 scalar.
        """
        base = self.learning_rate
        if isinstance(base, LearningRateSchedule):
            base = base(scale_invariant_step)
        return ops.multiply(
            ops.cast(base, "float32"),
            self.factor(scale_invariant_step, steps),
        )

    def get_config(self) -> dict[str, Any]:
        learning_rate = self.learning_rate
        if isinstance(learning_rate, LearningRateSchedule):
            learning_rate = keras.saving.serialize_keras_object(learning_rate)
        return {
            "learning_rate": learning_rate,
            "base_batch_size": self.base_batch_size,
        }


@register_keras_serializable(package=_PACKAGE)
class AdaScaleLearningRate(WindowScaledLearningRate):
    """The AdaScale learning rate (`adascale`).

    An accumulating optimizer evaluates it at its scale-invariant step with
    its gain; any other optimizer would call it with its update count, so
    calling it raises.

    Args:
        learning_rate: a float, or a `LearningRateSchedule`.
        base_batch_size: Number > 0, see `adascale`.
    """

    _needs = " with `measure_noise_scale=True`"

    def factor(self, scale_invariant_step: Any, steps: Any) -> Any:
        """The gain `r`: the base steps the update stands for."""
        return steps

    def __repr__(self) -> str:
        return (
            f"adascale({self.learning_rate!r}, "
            f"base_batch_size={self.base_batch_size!r})"
        )
