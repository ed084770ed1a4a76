"""Fit the batch to the memory: a target batch, the largest micro-batch
that fits, and recovery from out-of-memory errors.

`fit_to_memory(model, x, y, target_batch_size=T)` trains like the parent
optimizer with `batch_size=T`: each window of `accum_iters` micro-batches
is one big batch of `T` consecutive samples (the epoch's last one shorter,
applied at the epoch's end, as the parent's short last batch). The
micro-batch `b` is the largest that fits; the window of `T` samples is cut
into micro-batches of `b`, its last one shorter where `b` does not divide
`T`, so `accum_iters = ceil(T / b)`. Micro-batches are weighed by their
loss's count (`weigh_micro_batches`): a window's update is the big batch's
mean gradient whatever the micro-batches' sizes.

`b` comes from a plan (`plan_micro_batch`): the smallest window size `k`
(`b = ceil(T / k)`) whose train step fits, found by doubling `k` and then
bisecting. With a `memory_limit`, JAX compiles the train step for each
candidate and reads its peak from XLA's memory analysis, without running
it (on the CPU too). Without one, each candidate runs one real train step,
the window's last (the update included), from a copy of the state on the
host, which is put back after: a step that raises the backend's
out-of-memory error means "does not fit".

When a train step runs out of memory later, `b` is halved and the epoch
continues from the first sample the failed step held: the pending window
keeps its sums and total weight; only its count of micro-steps changes,
to what the window's remaining samples need at the new size (double, for
an even `b` that divides `T`).
"""

import keras
import numpy as np
from keras import backend
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers import schedules
from accum_optimizers._inner import accumulating_optimizers
from accum_optimizers._memory import compiled_peak
from accum_optimizers._memory import format_bytes
from accum_optimizers._memory import free_memory
from accum_optimizers._memory import is_out_of_memory
from accum_optimizers._memory import memory_limit_bytes
from accum_optimizers._memory import probe
from accum_optimizers._micro_batches import EpochOrder
from accum_optimizers._micro_batches import MicroBatches
from accum_optimizers._micro_batches import arrays
from accum_optimizers._micro_batches import head
from accum_optimizers._micro_batches import sample_count
from accum_optimizers.callbacks import FlushAccumulation
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
        target_batch_size,
        micro_batch_size,
        peak_bytes=None,
        memory_limit=None,
        method="given",
        probes=(),
    ):
        self.target_batch_size = target_batch_size
        self.micro_batch_size = micro_batch_size
        self.peak_bytes = peak_bytes
        self.memory_limit = memory_limit
        self.method = method
        self.probes = list(probes)
        self.recoveries = []

    @property
    def accum_iters(self):
        return -(-self.target_batch_size // self.micro_batch_size)

    def __repr__(self):
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
    model,
    x,
    y=None,
    *,
    target_batch_size,
    sample_weight=None,
    memory_limit=None,
    micro_batch_size=None,
):
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
    """
    target = _positive_int("target_batch_size", target_batch_size)
    limit = memory_limit_bytes(memory_limit)
    if micro_batch_size is not None:
        micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        if micro_batch_size > target:
            raise ValueError(
                "`micro_batch_size` must be at most `target_batch_size`. "
                f"Received: micro_batch_size={micro_batch_size}, "
                f"target_batch_size={target}"
            )
    if limit is not None and backend.backend() != "jax":
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
        _set_window(model, optimizers, target, micro_batch_size)
        peak = None
        if backend.backend() == "jax":
            peak = compiled_peak(model, head(data, micro_batch_size))
        return MicroBatchPlan(target, micro_batch_size, peak, limit)

    if limit is not None:

        def fits(size):
            _set_window(model, optimizers, target, size)
            peak = compiled_peak(model, head(data, size))
            return peak <= limit, peak

        method = "memory_analysis"
    else:

        def fits(size):
            _set_window(model, optimizers, target, size)
            return probe(model, optimizers, head(data, min(size, count)))

        method = "out_of_memory_probes"
    probes = []
    tried = {}

    def try_size(size):
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
            _set_window(model, optimizers, target, target)
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
    _set_window(model, optimizers, target, size)
    return MicroBatchPlan(target, size, tried[size][1], limit, method, probes)


def fit_to_memory(
    model,
    x,
    y=None,
    *,
    target_batch_size,
    epochs=1,
    sample_weight=None,
    memory_limit=None,
    micro_batch_size=None,
    shuffle=True,
    seed=None,
    callbacks=None,
    validation_data=None,
    verbose="auto",
    initial_epoch=0,
):
    """Trains at a target batch with the largest micro-batch that fits,
    exactly like the parent optimizer with `batch_size=target_batch_size`.

    Plans the micro-batch (`plan_micro_batch`, unless one is given), then
    runs `model.fit` over windows of `target_batch_size` consecutive
    samples, each cut into micro-batches (its last one shorter where the
    micro-batch does not divide the target), and applies the epoch's short
    last window at the epoch's end. When a train step runs out of device
    memory (TensorFlow's `ResourceExhaustedError`, JAX's
    `RESOURCE_EXHAUSTED` runtime error, torch's `OutOfMemoryError`), the
    micro-batch is halved, `accum_iters` raised to match, and training
    continues from the failed micro-batch's first sample, with the
    pending window and the epoch's order kept; any other error propagates.

    Callbacks see one `fit` from the start, and a new one from each
    recovery (`on_train_begin` again); the recovered epoch's logs cover
    its part after the recovery. Returns the `History` of every epoch,
    with the plan as `history.plan`.

    Args:
        model: a compiled `keras.Model` whose optimizer accumulates (see
            `plan_micro_batch`), with `steps_per_execution=1`.
        x: the inputs: a numpy array, or a list, tuple or dict of them
            (backend tensors are copied to numpy). Datasets, generators
            and `PyDataset`s are refused: recovery needs to re-cut the
            epoch's samples.
        y: the targets, structured like `x`, or `None`.
        target_batch_size: Integer >= 1, the batch size the training
            stands for.
        epochs: Integer, the epoch to end at (as `fit`'s). Defaults to
            `1`.
        sample_weight: Optional array of per-sample weights.
        memory_limit: Optional bytes to plan against (JAX; see
            `plan_micro_batch`). Defaults to `None`.
        micro_batch_size: Optional micro-batch to start from, without
            planning. Defaults to `None`.
        shuffle: Boolean. Shuffle the samples before each epoch, with a
            permutation drawn from `seed` and the epoch's number (the
            same after a recovery). Defaults to `True`.
        seed: Optional integer seed of the permutations. Defaults to
            `None`: `0`.
        callbacks: Optional list of Keras callbacks. A
            `FlushAccumulation` is added unless the list holds one (which
            must flush every epoch).
        validation_data: Optional `(x_val, y_val)` or `(x_val, y_val,
            sample_weight_val)`, evaluated at each epoch's end at the
            micro-batch size.
        verbose: `"auto"`, 0, 1 or 2, as `fit`'s; above 0 it also prints
            the plan and each recovery. Defaults to `"auto"`.
        initial_epoch: Integer, the epoch to start at. Defaults to `0`.

    Returns:
        A `keras.callbacks.History`, with a `plan` attribute: the
        `MicroBatchPlan`, whose `micro_batch_size` is the one training
        ended with and whose `recoveries` lists the recoveries.
    """
    epochs = _non_negative_int("epochs", epochs)
    initial_epoch = _non_negative_int("initial_epoch", initial_epoch)
    if not isinstance(shuffle, bool):
        raise TypeError(f"`shuffle` must be a bool. Received: {shuffle!r}")
    seed = 0 if seed is None else _non_negative_int("seed", seed)
    if getattr(model, "steps_per_execution", 1) != 1:
        raise ValueError(
            "fit_to_memory needs `steps_per_execution=1` in `compile`: an "
            "out-of-memory error inside a multi-step execution leaves the "
            "steps before it applied and unaccounted for. Received: "
            f"steps_per_execution={model.steps_per_execution}"
        )
    data = arrays(x, y, sample_weight)
    plan = plan_micro_batch(
        model,
        data[0],
        data[1],
        target_batch_size=target_batch_size,
        sample_weight=data[2],
        memory_limit=memory_limit,
        micro_batch_size=micro_batch_size,
    )
    printing = verbose != 0
    if printing:
        print(f"fit_to_memory: {plan}")
    optimizers = accumulating_optimizers(model.optimizer)
    order = EpochOrder(sample_count(data), shuffle, seed)
    tracker = _Tracker(optimizers, plan.target_batch_size)
    callbacks = [tracker] + _with_flush(callbacks)
    epoch, start = initial_epoch, 0
    model.stop_training = False
    while epoch < epochs and not model.stop_training:
        batches = MicroBatches(
            data,
            order,
            plan.target_batch_size,
            plan.micro_batch_size,
            start,
        )
        tracker.begin(batches)
        # A resumed epoch is its own `fit`; the ones after it, another.
        end = epoch + 1 if start else epochs
        error = _fit_until_out_of_memory(
            model,
            batches,
            epochs=end,
            initial_epoch=epoch,
            callbacks=callbacks,
            validation_data=validation_data,
            validation_batch_size=plan.micro_batch_size,
            verbose=verbose,
        )
        if error is None:
            epoch, start = end, 0
            continue
        epoch, start = tracker.epoch, tracker.position
        if tracker.iterations is not None:
            for optimizer, count in zip(optimizers, tracker.iterations):
                optimizer.iterations.assign(np.array(count, "int64"))
        size = plan.micro_batch_size
        if size == 1 or not tracker.in_step:
            # Nothing smaller to try, or not a train step's (validation's):
            # the epoch's training already ended.
            raise error
        tracker.check_recoverable(error)
        del error  # its traceback holds the failed step's buffers
        free_memory(model)
        new_size = -(-size // 2)
        plan.recoveries.append((epoch, start, size, new_size))
        plan.micro_batch_size = new_size
        _set_window(model, optimizers, plan.target_batch_size, new_size)
        tracker.window_steps = _continue_window(optimizers, plan, start)
        if printing:
            print(
                f"fit_to_memory: out of memory at micro-batch {size} (epoch "
                f"{epoch + 1}, sample {start}); continuing with micro-batch "
                f"{new_size} x accum_iters {plan.accum_iters}"
            )
    history = keras.callbacks.History()
    history.set_model(model)
    history.epoch = sorted(tracker.logs)
    history.history = {}
    for number in history.epoch:
        for key, value in tracker.logs[number].items():
            history.history.setdefault(key, []).append(value)
    history.plan = plan
    model.history = history
    return history


# -- Checks -----------------------------------------------------------------


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
        )
    if value < 1:
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
        )
    return int(value)


def _non_negative_int(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < 0
    ):
        raise ValueError(
            f"`{name}` must be an integer >= 0. Received: {name}={value!r}"
        )
    return int(value)


def _prepared_optimizers(model):
    """The model's accumulating optimizers, checked for a plan to set."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a `keras.Model`. Received: model={model!r}"
        )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError("fit_to_memory: compile the model first.")
    optimizers = accumulating_optimizers(optimizer)
    if not optimizers or len(optimizers) != _inner_count(optimizer):
        raise ValueError(
            "fit_to_memory needs an accumulating optimizer (an "
            "`accum_optimizers` class or `accumulating(cls)`, possibly in a "
            "`LossScaleOptimizer`): it sets `accum_iters`. Received: "
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
        if inner_optimizer.built and not hasattr(
            inner_optimizer, "_accum_sums"
        ):
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


def _with_flush(callbacks):
    """`callbacks` with a `FlushAccumulation` that flushes every epoch: the
    epoch's short last window is the parent's short last batch."""
    callbacks = list(callbacks or [])
    flushes = [c for c in callbacks if isinstance(c, FlushAccumulation)]
    for flush in flushes:
        if not flush.every_epoch:
            raise ValueError(
                "fit_to_memory applies each epoch's short last window at "
                "the epoch's end, as the parent applies its short last "
                "batch. Received: FlushAccumulation(every_epoch=False)"
            )
    return callbacks if flushes else [FlushAccumulation()] + callbacks


def _inner_count(optimizer):
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return len(getattr(optimizer, "optimizers", [optimizer]))


# -- The window -----------------------------------------------------------


def _build(model, optimizers, data):
    """Builds the model, its metrics and the optimizer (with its window
    state: built at `accum_iters >= 2`), as `fit` would on `data`."""
    for optimizer in optimizers:
        if not optimizer.built:
            optimizer.accum_iters = max(2, optimizer.accum_iters)
    _keras_private.symbolic_build(model, head(data, 1))
    for optimizer in optimizers:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)


def _set_window(model, optimizers, target, size):
    """`accum_iters` for micro-batches of `size`; the train function, which
    reads it as a constant, is traced again."""
    for optimizer in optimizers:
        optimizer.accum_iters = -(-target // size)
    model.train_function = None


def _continue_window(optimizers, plan, position):
    """The pending window's micro-step count at the new micro-batch size:
    what closes it after the micro-batches its remaining samples need.
    The sums and total weight stay: the window is weighted."""
    done = position % plan.target_batch_size
    remaining = -(-(plan.target_batch_size - done) // plan.micro_batch_size)
    micro_steps = plan.accum_iters - remaining if done else 0
    for optimizer in optimizers:
        optimizer._accum_micro_steps.assign(np.array(micro_steps, "int32"))
    return micro_steps


# -- Training ---------------------------------------------------------------


def _commits(optimizers):
    """Each optimizer's count of `apply` calls it committed: micro-batches
    added and skipped."""
    return [
        int(ops.convert_to_numpy(optimizer.micro_batches_seen))
        + int(ops.convert_to_numpy(optimizer.skipped_micro_batches))
        for optimizer in optimizers
    ]


def _fit_until_out_of_memory(model, batches, **kwargs):
    """Runs `model.fit(batches, ...)`; returns the out-of-memory error that
    ended it, or `None`."""
    try:
        model.fit(batches, shuffle=False, **kwargs)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        return error
    return None


class _Tracker(keras.callbacks.Callback):
    """Where training is: the epoch, the first sample of the micro-batch
    being trained, the micro-steps the pending window has taken, and each
    finished epoch's logs; and whether a failed step can be retried.

    Args:
        optimizers: the model's accumulating optimizers.
        target: the target batch size, the samples of a window.
    """

    def __init__(self, optimizers, target):
        super().__init__()
        self.logs = {}
        self.epoch = 0
        self.position = 0
        self.iterations = None
        self.window_steps = 0
        self._optimizers = optimizers
        self._target = target
        self._batches = None
        self._commits = None

    def begin(self, batches):
        self._batches = batches
        self.in_step = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self._batches.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.position = self._batches.bounds[batch][0]
        if self.position % self._target == 0:
            self.window_steps = 0
        self.in_step = True
        model = self.model
        self.iterations = None
        if backend.backend() == "tensorflow" and not all(
            optimizer._accumulates for optimizer in self._optimizers
        ):
            # The parent optimizer's graph adds 1 to `iterations` without
            # waiting for the step's gradients: a step that fails may have
            # counted an update it did not apply.
            self.iterations = [
                int(ops.convert_to_numpy(optimizer.iterations))
                for optimizer in self._optimizers
            ]
        if backend.backend() == "jax":
            if _keras_private.jax_fit_takes_state_from_variables(model):
                # If the step fails, `fit` puts back a state it holds: an
                # older one (a probe's, or the epoch's before its flush) or
                # none. The state is the variables'.
                _keras_private.set_jax_state_to_variables(model)
        else:
            # A JAX step writes all of its state or none; a TensorFlow or
            # torch step that fails may have written part of it.
            self._commits = _commits(self._optimizers)

    def check_recoverable(self, error):
        """Raises, naming what happened, unless the failed step left the
        optimizers as they were before it and the pending window is the
        one the plan's samples make (so that retrying its samples at a
        smaller micro-batch is exact)."""
        if self._commits is not None and _commits(self._optimizers) != (
            self._commits
        ):
            raise RuntimeError(
                "fit_to_memory: the device ran out of memory after the "
                "train step had begun to write the optimizer's state (in "
                "the window's update): the step cannot be undone, so "
                "training cannot continue exactly. The model and optimizer "
                "hold what the step wrote; restore them from a checkpoint "
                "and call fit_to_memory with a smaller micro_batch_size. "
                f"The error: {error!r}"
            ) from error
        pending = [
            int(ops.convert_to_numpy(optimizer.micro_steps))
            for optimizer in self._optimizers
        ]
        if any(count != self.window_steps for count in pending):
            raise RuntimeError(
                "fit_to_memory: the device ran out of memory in a window "
                "that a skipped micro-batch regrouped (`skip_nonfinite`, "
                "or a LossScaleOptimizer's skip of non-finite gradients): "
                f"it holds {pending[0]} micro-batches where the plan's "
                f"samples make {self.window_steps}, so the window cannot be "
                "re-cut at a smaller micro-batch exactly. The model and "
                "optimizer are as they were before the failed step; call "
                "fit_to_memory with a smaller micro_batch_size. The error: "
                f"{error!r}"
            ) from error

    def on_train_batch_end(self, batch, logs=None):
        self.in_step = False
        self.window_steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self.logs[epoch] = dict(logs or {})
