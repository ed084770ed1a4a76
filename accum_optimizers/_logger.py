"""`AccumulationLogger`: applied updates, the pending window and the last
window's own metrics in `fit`'s logs and TensorBoard."""

import os
import warnings
from typing import Any
from typing import Optional
from typing import Union
from typing import cast

import keras
import numpy as np
from keras import ops
from keras.saving import register_keras_serializable

from accum_optimizers import _tensorboard
from accum_optimizers import schedules
from accum_optimizers._inner import accumulating_of_model
from accum_optimizers._inner import count_updates_in_multi_optimizer
from accum_optimizers._inner import refuse_skips_with_accum_batch_norm
from accum_optimizers._inner import shown_window
from accum_optimizers._inner import window_of
from accum_optimizers._window.adascale import follows
from accum_optimizers._window.adascale import uses_adascale
from accum_optimizers._window.noise import measuring
from accum_optimizers._window.noise import read_outs_of


@register_keras_serializable(package="accum_optimizers")
class AccumulationLogger(keras.callbacks.Callback):
    """Shows applied updates, the pending window and the last window's own
    metrics in `fit`'s logs.

    `fit` counts micro-batches (the progress bar's steps); the weights move
    once per window of `accum_iters` of them. At the end of every epoch (and,
    with `update_freq`, after every few batches) this callback adds to
    `logs`:

    - `updates`: applied updates, `optimizer.iterations`;
    - `micro_steps`: micro-batches pending in the current window;
    - `window_loss`: the last applied window's loss, the mean of its
      micro-batches' losses weighed like their gradients: within a window
      the weights do not move, so this is the big batch's loss (Keras'
      `loss` is a running mean over the epoch's micro-batches);
    - `window_grad_norm`: the norm of that window's mean gradient, before
      clipping: the big batch's gradient norm;
    - `skipped_micro_batches`: micro-batches left out for non-finite
      gradients (`skip_nonfinite=True`);
    - `samples_seen`: the total weight of the applied windows (samples
      under `weigh_micro_batches`, micro-batches otherwise);
    - with `measure_noise_scale=True`: `noise_scale` (`B_simple`, in the
      unit of `samples_seen`), `gradient_sq_norm` and
      `gradient_noise_trace`, its two moving averages (under a
      `MultiOptimizer`, the components summed over the inner optimizers
      that measure them, and their ratio);
    - with `learning_rate=schedules.adascale(...)`: `adascale_gain`, the
      last update's gain, and `scale_invariant_step`, the base schedule's
      progress (stop when it reaches the base run's length); with
      `schedules.linear_scaling(...)` or `sqrt_scaling(...)`:
      `window_scale`, the last update's `S`, and `scale_invariant_step`.

    The progress bar then shows them beside the loss, `History` records
    their values at each epoch's end, and callbacks listed after this one
    (`keras.callbacks.TensorBoard`, `CSVLogger`) see them too. List it after
    `FlushAccumulation` so that the epoch's values include the flushed
    window. `windows` keeps one entry per applied update the logger saw
    (every update with `update_freq="batch"`).

    With `log_dir`, it also writes these TensorBoard scalars to
    `log_dir/train`, the run where `keras.callbacks.TensorBoard(log_dir)`
    writes its training scalars, each with step = applied updates:

    - `accumulation/updates`: applied updates;
    - `accumulation/micro_batches`: micro-batches seen
      (`optimizer.micro_batches_seen`);
    - `accumulation/window_fill`: `micro_steps / accum_iters`, from 0 (no
      window pending) up to `(accum_iters - 1) / accum_iters`;
    - `accumulation/effective_batch_size`: `batch_size * accum_iters` of
      the window that produced the update at that step, the batch it
      averaged over (only when `batch_size` is given and `accum_iters` is
      not keyed on samples; a flushed partial window averages over fewer
      samples);
    - `accumulation/window_loss`, `accumulation/window_grad_norm`,
      `accumulation/skipped_micro_batches`, `accumulation/samples_seen`
      the noise scale's three and AdaScale's or a scaling rule's two:
      as in `logs`.

    A point is written at each epoch's end and, with `update_freq`, after
    batches that applied an update; none before the first update. The
    event file is written by the `tensorboard` package (or TensorFlow's
    `tf.summary` where only TensorFlow is installed), on every Keras
    backend.

    On JAX, reading the optimizer's counters after a batch makes Keras
    attach the training state to the model (as any callback that reads
    `self.model` does), so `update_freq=1` costs some speed there.

    Args:
        log_dir: Path-like or `None`. The directory given to
            `keras.callbacks.TensorBoard`. `None` (the default) writes no
            event files, only `logs`.
        batch_size: Integer >= 1 or `None`. The `batch_size` given to
            `fit`, for `accumulation/effective_batch_size`. Defaults to
            `None` (that scalar is not written).
        update_freq: `"epoch"`, `"batch"` or an integer `N >= 1`. With
            `"epoch"` (the default), the values are logged at the end of
            each epoch only; with `N`, also after every `N` training batches
            (micro-batches, also with `steps_per_execution`; `"batch"` is
            `1`), so the progress bar shows them as it runs. The logger
            reads the optimizer between executions: with
            `steps_per_execution` above `accum_iters` an execution applies
            several updates and only its last is recorded (it warns when
            training starts).

    Attributes:
        windows: dict of lists, one item per applied update seen by the
            logger: `updates`, `window_loss`, `window_grad_norm`,
            `skipped_micro_batches`, `samples_seen`, `window_fill`
            (`micro_steps / accum_iters` when it was seen) and, when the
            noise scale is measured, its three.
    """

    def __init__(
        self,
        log_dir: Optional[Union[str, os.PathLike]] = None,
        batch_size: Optional[int] = None,
        update_freq: Union[str, int] = "epoch",
    ) -> None:
        super().__init__()
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                "`log_dir` must be a path (str or os.PathLike) or None. "
                f"Received: log_dir={log_dir!r} of type "
                f"{type(log_dir).__name__}"
            )
        if log_dir is not None and not _tensorboard.available():
            raise ImportError(
                f"{_tensorboard.INSTALL_HINT} Received: log_dir={log_dir!r}"
            )
        if batch_size is not None and not _is_positive_int(batch_size):
            raise ValueError(
                "`batch_size` must be an integer >= 1 or None. "
                f"Received: batch_size={batch_size!r}"
            )
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and not _is_positive_int(update_freq):
            raise ValueError(
                '`update_freq` must be "epoch", "batch" or an integer >= 1. '
                f"Received: update_freq={update_freq!r}"
            )
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.update_freq = (
            update_freq if update_freq == "epoch" else int(update_freq)
        )
        # Keras may run batch-end callbacks in a thread while the next step
        # trains; only a logger that reads nothing there allows it.
        self.async_safe = self.update_freq == "epoch"
        self._writer: Any = None
        self._batches = 0
        self._written: tuple[int, int] | None = None
        self.windows: dict[str, list[Any]] = {
            name: [] for name in _WINDOW_RECORD
        }

    def _optimizer(self) -> keras.optimizers.Optimizer:
        """The accumulating optimizer whose counters are logged: the
        model's, or the first of a `MultiOptimizer`'s, whose inner
        accumulating optimizers must then share one `accum_iters`."""
        optimizers = accumulating_of_model(self.model, "AccumulationLogger")
        sizes = [window_of(o) for o in optimizers]
        if any(size != sizes[0] for size in sizes[1:]):
            shown = ", ".join(shown_window(size) for size in sizes)
            raise ValueError(
                "AccumulationLogger logs one window, but the "
                "MultiOptimizer's accumulating optimizers have different "
                f"windows: accum_iters=[{shown}]. Give them the same "
                "`accum_iters`."
            )
        return optimizers[0]

    def on_train_begin(self, logs: Optional[dict[str, Any]] = None) -> None:
        self._optimizer()  # Fails before the first batch, not after it.
        refuse_skips_with_accum_batch_norm(
            self.model, accumulating_of_model(self.model, "AccumulationLogger")
        )
        count_updates_in_multi_optimizer(self.model.optimizer)
        self._warn_of_unseen_updates()
        self._batches = 0
        self._epoch_batches = 0
        self._written = None
        self._record: tuple[str, ...] = _WINDOW_RECORD
        if measuring(accumulating_of_model(self.model, "AccumulationLogger")):
            self._record = _WINDOW_RECORD + _NOISE_RECORD
        self._record += _scaling_record(self._optimizer())
        self.windows = {name: [] for name in self._record}
        if self.log_dir is not None:
            self._writer = _tensorboard.scalar_writer(
                os.path.join(self.log_dir, "train")
            )

    def _warn_of_unseen_updates(self) -> None:
        """Warns when an execution can apply several updates: the logger
        sees the optimizer between executions only, so it records the last
        update of each."""
        steps = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if self.update_freq == "epoch" or steps == 1:
            return
        optimizer = self._optimizer()
        smallest = schedules.get(optimizer.accum_iters)
        if isinstance(smallest, schedules.AccumSchedule):
            smallest = smallest.min_accum_iters
        # An execution of at most `smallest` micro-batches closes at most
        # one window (a skipped micro-batch only makes one longer).
        if steps <= smallest:
            return
        accum_iters = optimizer.current_accum_iters
        warnings.warn(
            f"AccumulationLogger(update_freq={self.update_freq!r}) sees the "
            "optimizer between executions only: with "
            f"steps_per_execution={steps} and accum_iters={accum_iters} an "
            "execution can apply several updates, and only the last of each "
            "is recorded in `windows`, the logs and TensorBoard. Compile "
            "with steps_per_execution <= accum_iters to record every "
            "update.",
            stacklevel=2,
        )

    def on_train_batch_end(
        self, batch: int, logs: Optional[dict[str, Any]] = None
    ) -> None:
        if self.update_freq == "epoch":
            return
        # `batch` is the index of the execution's last micro-batch in the
        # epoch: with `steps_per_execution`, one call ends several.
        before = self._batches
        self._batches += batch + 1 - self._epoch_batches
        self._epoch_batches = batch + 1
        every = cast(int, self.update_freq)
        if self._batches // every > before // every:
            self._log(logs, new_updates_only=True)

    def on_epoch_begin(
        self, epoch: int, logs: Optional[dict[str, Any]] = None
    ) -> None:
        self._epoch_batches = 0

    def on_epoch_end(
        self, epoch: int, logs: Optional[dict[str, Any]] = None
    ) -> None:
        self._log(logs, new_updates_only=False)

    def on_train_end(self, logs: Optional[dict[str, Any]] = None) -> None:
        if self._writer is None:
            return
        # A window flushed by `FlushAccumulation.on_train_end`.
        self._log(None, new_updates_only=False)
        self._writer.close()
        self._writer = None

    def _log(
        self, logs: Optional[dict[str, Any]], new_updates_only: bool
    ) -> None:
        optimizer = self._optimizer()
        updates = int(ops.convert_to_numpy(optimizer.iterations))
        micro_steps = int(ops.convert_to_numpy(optimizer.micro_steps))
        accum_iters = optimizer.current_accum_iters
        metrics = {
            "window_loss": float(ops.convert_to_numpy(optimizer.window_loss)),
            "window_grad_norm": float(
                ops.convert_to_numpy(optimizer.window_grad_norm)
            ),
            "skipped_micro_batches": int(
                ops.convert_to_numpy(optimizer.skipped_micro_batches)
            ),
            "samples_seen": float(ops.convert_to_numpy(optimizer.samples_seen)),
        }
        optimizers = measuring(
            accumulating_of_model(self.model, "AccumulationLogger")
        )
        if optimizers:
            metrics.update(read_outs_of(optimizers))
        for name in _scaling_record(optimizer):
            metrics[name] = float(
                ops.convert_to_numpy(getattr(optimizer, name))
            )
        if isinstance(logs, dict):
            logs["updates"] = updates
            logs["micro_steps"] = micro_steps
            logs.update(metrics)
        recorded = self.windows["updates"]
        if updates > 0 and (not recorded or recorded[-1] != updates):
            record = dict(
                metrics, updates=updates, window_fill=micro_steps / accum_iters
            )
            for name in self.windows:
                self.windows[name].append(record[name])
        # Before the first update there is no window to show: its loss,
        # gradient norm and noise scale would be placeholders at step 0.
        if self._writer is None or updates == 0:
            return
        last = self._written or (None, None)
        if (updates, micro_steps) == last or (
            new_updates_only and updates == last[0]
        ):
            return
        self._written = (updates, micro_steps)
        seen = int(ops.convert_to_numpy(optimizer.micro_batches_seen))
        scalars = {
            "updates": updates,
            "micro_batches": seen,
            "window_fill": micro_steps / accum_iters,
            **metrics,
        }
        keyed_on_samples = schedules.keyed_on_samples(
            optimizer.accum_iters
        ) or schedules.keyed_on_noise_scale(optimizer.accum_iters)
        if self.batch_size is not None and not keyed_on_samples:
            # (Keyed on samples or the noise scale, the size of a past
            # window is not known.)
            # The window that produced update `updates` (counting from 1)
            # had the size the schedule gave at `updates - 1`.
            produced = schedules.get(optimizer.accum_iters)
            if isinstance(produced, schedules.AccumSchedule):
                produced = ops.cast(produced(max(updates - 1, 0)), "int32")
            produced = int(ops.convert_to_numpy(produced))
            scalars["effective_batch_size"] = self.batch_size * produced
        for name, value in scalars.items():
            self._writer.scalar(f"accumulation/{name}", value, step=updates)

    def get_config(self) -> dict[str, Any]:
        return {
            "log_dir": self.log_dir,
            "batch_size": self.batch_size,
            "update_freq": self.update_freq,
        }


# What `AccumulationLogger.windows` records for each update.
_WINDOW_RECORD = (
    "updates",
    "window_loss",
    "window_grad_norm",
    "skipped_micro_batches",
    "samples_seen",
    "window_fill",
)


# What it records besides, with `measure_noise_scale=True`.
_NOISE_RECORD = ("noise_scale", "gradient_sq_norm", "gradient_noise_trace")


# And with an AdaScale learning rate, or a scaling rule's.
_ADASCALE_RECORD = ("adascale_gain", "scale_invariant_step")
_SCALING_RULE_RECORD = ("window_scale", "scale_invariant_step")


def _scaling_record(optimizer: Any) -> tuple[str, ...]:
    """What it records of `optimizer`'s learning rate that follows the
    window: AdaScale's two, a scaling rule's two, or nothing."""
    if uses_adascale(optimizer):
        return _ADASCALE_RECORD
    if follows(optimizer):
        return _SCALING_RULE_RECORD
    return ()


def _is_positive_int(value: Any) -> bool:
    return bool(
        isinstance(value, (int, np.integer))
        and not isinstance(value, (bool, np.bool_))
        and value >= 1
    )
