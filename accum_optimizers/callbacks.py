"""Keras callbacks for accumulating optimizers."""

from typing import Any
from typing import Optional

import keras
from keras.saving import register_keras_serializable


def accumulating_optimizer(
    optimizer: keras.optimizers.Optimizer,
) -> Optional[keras.optimizers.Optimizer]:
    """The accumulating optimizer inside `optimizer`, or `None`.

    Unwraps `keras.optimizers.LossScaleOptimizer` (which `compile` adds under
    the `mixed_float16` policy).
    """
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if hasattr(optimizer, "flush") else None


@register_keras_serializable(package="accum_optimizers")
class FlushAccumulation(keras.callbacks.Callback):
    """Applies a pending partial accumulation window at epoch/training end.

    An epoch of `n` batches with `accum_iters=k` leaves `n % k` micro-batches
    pending. Without this callback they are carried into the next epoch's
    first window (as Keras' built-in accumulation always does). With it, they
    are applied as one update averaged over the micro-batches they hold: 10
    batches with `accum_iters=4` give updates from 4, 4 and 2 batches, the
    groupings of a parent-optimizer run with `batch_size=4*b` (whose last
    batch is short).

    Args:
        every_epoch: Boolean. Flush at the end of every epoch. Defaults to
            `True`.
        at_train_end: Boolean. Flush at the end of training: at the end of
            the last epoch (before `fit` overwrites weights with their EMA
            when `use_ema=True`), and again in `on_train_end` if training
            stopped early with a window pending. Defaults to `True`.
    """

    def __init__(
        self, every_epoch: bool = True, at_train_end: bool = True
    ) -> None:
        super().__init__()
        for name, value in (
            ("every_epoch", every_epoch),
            ("at_train_end", at_train_end),
        ):
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{name}` must be a bool. Received: {name}={value!r}"
                )
        self.every_epoch = every_epoch
        self.at_train_end = at_train_end

    def _flush(self) -> None:
        optimizer = accumulating_optimizer(self.model.optimizer)
        if optimizer is None:
            raise ValueError(
                "FlushAccumulation needs an accumulating optimizer "
                "(an `accum_optimizers` class or `accumulating(cls)`). "
                f"Received: optimizer={self.model.optimizer!r}"
            )
        optimizer.flush()

    def on_epoch_end(
        self, epoch: int, logs: Optional[dict[str, Any]] = None
    ) -> None:
        last_epoch = epoch + 1 == self.params.get("epochs")
        if self.every_epoch or (self.at_train_end and last_epoch):
            self._flush()

    def on_train_end(self, logs: Optional[dict[str, Any]] = None) -> None:
        if self.at_train_end:
            self._flush()

    def get_config(self) -> dict[str, Any]:
        return {
            "every_epoch": self.every_epoch,
            "at_train_end": self.at_train_end,
        }
