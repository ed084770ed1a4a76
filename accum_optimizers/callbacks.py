"""Keras callbacks for accumulating optimizers: `FlushAccumulation` here,
`AccumulationLogger` in `_logger.py`."""

from typing import Any
from typing import Optional

import keras
from keras.saving import register_keras_serializable

from accum_optimizers import _fit_scope
from accum_optimizers import _keras_private
from accum_optimizers._inner import accumulating_of_model
from accum_optimizers._inner import accumulating_optimizers
from accum_optimizers._inner import count_updates_in_multi_optimizer
from accum_optimizers._inner import refuse_skips_with_accum_batch_norm
from accum_optimizers._logger import AccumulationLogger
from accum_optimizers.layers import AccumBatchNormalization

__all__ = ["AccumulationLogger", "FlushAccumulation"]


@register_keras_serializable(package="accum_optimizers")
class FlushAccumulation(keras.callbacks.Callback):
    """Applies a pending partial accumulation window at epoch/training end.

    An epoch of `n` batches with `accum_iters=k` leaves `n % k` micro-batches
    pending. Without this callback they are carried into the next epoch's
    first window (as Keras' built-in accumulation always does). With it, they
    are applied as one update averaged over the micro-batches they hold: 10
    batches with `accum_iters=4` give updates from 4, 4 and 2 batches, the
    groupings of a parent-optimizer run with `batch_size=4*b` (whose last
    batch is short). The pending windows of the model's
    `AccumBatchNormalization` layers (nested models and custom layers
    included) are flushed with it.

    The epoch's flush runs right after its last training batch, before
    `fit` validates the epoch and before any callback's `on_epoch_end`,
    wherever this callback sits in the list: `val_loss`, `EarlyStopping`,
    `ModelCheckpoint` and pruning callbacks all see the flushed weights.
    Under a `MultiOptimizer`, every accumulating inner optimizer is
    flushed.

    Args:
        every_epoch: Boolean. Flush at the end of every epoch. Defaults to
            `True`.
        at_train_end: Boolean. Flush at the end of training: at the end of
            the last epoch (before `fit` overwrites weights with their EMA
            when `use_ema=True`), and again in `on_train_end` if training
            stopped early with a window pending. While it trains, the
            optimizers' `flush_at_train_end` is `True`: the end of `fit`
            leaves the window to this callback instead of warning that one
            is pending. A `fit` that raises leaves it `False`.
            Defaults to `True`.
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
        for optimizer in accumulating_of_model(self.model, "FlushAccumulation"):
            optimizer.flush()
        # Every sublayer, as Keras tracks them: inside nested models and
        # inside custom layers.
        for layer in _keras_private.sublayers(self.model):
            if isinstance(layer, AccumBatchNormalization):
                layer.flush()
        count_updates_in_multi_optimizer(self.model.optimizer)

    def on_train_begin(self, logs: Optional[dict[str, Any]] = None) -> None:
        self._unhook_epoch_end()  # Left by a `fit` that raised.
        optimizers = accumulating_of_model(self.model, "FlushAccumulation")
        refuse_skips_with_accum_batch_norm(self.model, optimizers)
        count_updates_in_multi_optimizer(self.model.optimizer)
        if self.at_train_end:
            # The optimizer's end-of-`fit` warning about a pending window
            # is for runs without this callback.
            for optimizer in optimizers:
                _fit_scope.set_for_this_fit(optimizer)
        self._epoch_flush_due = False
        self._evaluating = 0
        self._hook_epoch_end()

    def _hook_epoch_end(self) -> None:
        """Flushes where `fit` ends an epoch's training loop.

        Keras' `fit` validates the epoch before `on_epoch_end`, and calls
        the callbacks' `on_epoch_end` in list order; a flush there would
        come after `val_loss` and after a `ModelCheckpoint` listed first.
        Every backend's `fit` ends an epoch's training loop right after
        its last train step (after JAX puts the trained state back on the
        model) and before validation
        (`_keras_private.call_before_epoch_logs`): the flush runs there,
        whatever the number of steps.
        """
        model = self.model
        original_evaluate = model.evaluate

        def flush_if_due() -> None:
            if self._epoch_flush_due and not self._evaluating:
                self._epoch_flush_due = False
                self._flush()

        def evaluate(*args: Any, **kwargs: Any) -> Any:
            # An `evaluate` a callback runs mid-epoch does not end it.
            self._evaluating += 1
            try:
                return original_evaluate(*args, **kwargs)
            finally:
                self._evaluating -= 1

        _keras_private.call_before_epoch_logs(model, flush_if_due)
        model.evaluate = evaluate
        self._hooked = model

    def _unhook_epoch_end(self) -> None:
        model = self.__dict__.pop("_hooked", None)
        if model is not None:
            _keras_private.stop_calling_before_epoch_logs(model)
            del model.evaluate

    def on_epoch_begin(
        self, epoch: int, logs: Optional[dict[str, Any]] = None
    ) -> None:
        last_epoch = epoch + 1 == self.params.get("epochs")
        self._epoch_flush_due = self.every_epoch or (
            self.at_train_end and last_epoch
        )

    def on_epoch_end(
        self, epoch: int, logs: Optional[dict[str, Any]] = None
    ) -> None:
        # Where `fit` did not pass through the hook (a trainer of one's
        # own), the flush lands here.
        if self._epoch_flush_due:
            self._epoch_flush_due = False
            self._flush()

    def on_train_end(self, logs: Optional[dict[str, Any]] = None) -> None:
        self._unhook_epoch_end()
        if self.at_train_end:
            self._flush()
            for optimizer in accumulating_optimizers(self.model.optimizer):
                optimizer.flush_at_train_end = False

    def get_config(self) -> dict[str, Any]:
        return {
            "every_epoch": self.every_epoch,
            "at_train_end": self.at_train_end,
        }
