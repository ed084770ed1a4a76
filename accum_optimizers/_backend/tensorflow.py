"""TensorFlow: how a micro-step is arranged depends on how the graph runs.

`arrangement()` names the four ways, chosen once per micro-step:

- Eagerly, or in a plain graph (`tf.function` without XLA, no `merge_call`
  strategy): each gradient goes into its sum by a `tf.cond` of its own,
  then `tf.cond(closes, close)`. TensorFlow runs a function's side effects
  once all its inputs exist: a branch that took every gradient would hold
  them all until the backward pass ended, where the parent frees each as
  it applies it. In a plain graph the close is one XLA computation where
  the optimizer's `jit_compile` asks for it (`tensorflow_xla.py`).
- Under XLA: add on every micro-step (the select fuses into the add),
  then the close in a zero-or-once `tf.while_loop` (`_once_if`): XLA's
  conditional would copy every variable the close writes through the
  branch not taken, on every call.
- Under a strategy that synchronizes replicas with `merge_call` (every
  strategy on CPU, and without XLA on GPU): Keras updates mirrored
  variables in `merge_call`, which cannot run inside a control-flow branch
  built in replica context (keras-team/keras#20582). Each replica adds into
  its own replica-local sums; the gate is a `tf.cond` built in
  cross-replica context whose branch runs the close in each replica with
  `call_for_each_replica`, as Keras' `LossScaleOptimizer` does; the sums
  are all-reduced once, inside the close. The gradients go into the sums
  by one branch each, as in a plain graph.

The next window's first micro-step overwrites the sums (`assign(grad)`
hands the gradient's buffer to the variable, cheaper than zeroing into a
fresh buffer).
"""

import contextlib
import functools

import keras
import tensorflow as tf

from accum_optimizers import _keras_private
from accum_optimizers._backend import base
from accum_optimizers._backend.base import add_into_sums
from accum_optimizers._backend.base import keep_maximum
from accum_optimizers._backend.base import scaled
from accum_optimizers._backend.base import targets
from accum_optimizers._backend.base import write_counters
from accum_optimizers._backend.tensorflow_xla import compiled_close
from accum_optimizers._finite import all_finite
from accum_optimizers._finite import masked
from accum_optimizers._validation import MIN_WEIGHT

EAGER, GRAPH, XLA, MERGE_CALL = "eager", "graph", "xla", "merge_call"


def arrangement():
    """How the micro-step being built runs: `EAGER`, `GRAPH` (a
    `tf.function` without XLA), `XLA`, or `MERGE_CALL` (under a strategy
    whose update calls `merge_call`, eagerly or in a graph)."""
    if _keras_private.strategy_needs_merge_call():
        return MERGE_CALL
    if tf.executing_eagerly():
        return EAGER
    return XLA if _keras_private.in_xla_context() else GRAPH


class WindowBackend(base.WindowBackend):
    def read_gradients(self, grads, squares, finite):
        # An embedding's `IndexedSlices` may repeat a row: the rows are
        # merged first (a buffer the size of the slices, not of the
        # table), so that the squares are the dense gradient's.
        sq = None
        if squares:
            sq = sums_of_squares([_merged_rows(g) for g in grads])
        return sq, (all_finite(grads, squares=sq) if finite else None)

    def agree(self, flag):
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None or replica_context.num_replicas_in_sync == 1:
            return flag
        # One scalar per micro-step (tf.distribute reduces by sum or mean
        # only: count the replicas where it is false).
        false = replica_context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.cast(tf.logical_not(flag), "float32"),
        )
        return tf.equal(false, 0.0)

    def check_weight(self, weight):
        if zero_weight_allowed():
            valid = tf.math.is_finite(weight) & (
                (weight == 0) | (weight >= MIN_WEIGHT)
            )
        else:
            valid = tf.math.is_finite(weight) & (weight >= MIN_WEIGHT)
        if _keras_private.in_xla_context():
            # XLA drops assertions (under a strategy too): an invalid
            # weight makes the window's gradients NaN instead, which
            # `flush` discards and `TerminateOnNaN` stops on.
            weight = tf.where(valid, weight, float("nan"))
            return weight, contextlib.nullcontext()
        check = tf.debugging.Assert(
            valid,
            ["`weight` must be a finite number > 0. Received: weight=", weight],
        )
        return weight, tf.control_dependencies([check])

    def commit(self, window, step, grads, close):
        how = arrangement()
        if how == XLA:
            # XLA densifies `IndexedSlices`; the select fuses into the add.
            with _after(grads):
                write_counters(window, step)
            add_into_sums(self.optimizer, window, step, grads)
            return _once_if(step.closes, close, window.sums)
        with _after(grads):
            # Only the counters wait for every gradient: each sum waits for
            # its own, or each gradient would be held until the last one
            # exists.
            write_counters(window, step)
        if how == MERGE_CALL:
            # tf.distribute cannot scatter into a replica-local variable:
            # an embedding's `IndexedSlices` is added densely.
            grads = [_dense(g) for g in grads]
        if step.enters is None or how != GRAPH:
            self._add_each(
                window, step, [masked(g, step.enters) for g in grads]
            )
        else:
            # In a plain graph a branch runs only when taken: no masking
            # pass over the gradients of a skipped micro-batch.
            _branch(
                step.enters,
                lambda: self._add_each(window, step, grads),
                lambda: None,
            )
        with _after_count(window):
            if how == MERGE_CALL:
                return _run_in_each_replica_if(step.closes, close)
            if how == GRAPH:
                jit_compile = self.optimizer.jit_compile
                close = compiled_close(close, window, jit_compile)
            _branch(step.closes, close, lambda: None)

    def run_if(self, pred, fn):
        _branch(pred, fn, lambda: None)

    def reduce_window(self, sums, extras, total_weight):
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None or replica_context.num_replicas_in_sync == 1:
            return sums, extras, total_weight
        pinned = []
        values = sums + extras + [total_weight]
        device = values[0].device
        for value in values:
            # Inside a control-flow branch MultiWorkerMirroredStrategy
            # leaves ops without a device, and the all-reduce needs one.
            with tf.device(value.device or device):
                pinned.append(tf.identity(value))
        reduced = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, pinned)
        replicas = tf.cast(replica_context.num_replicas_in_sync, "float32")
        return (
            reduced[: len(sums)],
            reduced[len(sums) : -1],
            reduced[-1] / replicas,
        )

    def mean(self, sums, totals, divisor):
        # A multiply by the reciprocal: TensorFlow divides by a variable
        # with an elementwise `RealDiv`, several times slower.
        reciprocals = {}
        means = []
        for total in totals:
            if total.dtype not in reciprocals:
                reciprocals[total.dtype] = tf.math.reciprocal(
                    tf.cast(divisor, total.dtype)
                )
            means.append(total * reciprocals[total.dtype])
        return means

    def _add_each(self, window, step, grads):
        """Eagerly or in a graph without XLA: each gradient goes into its
        sum by a branch of its own, overwriting it on a new window, else
        adding (scattering `IndexedSlices` instead of densifying them)."""
        for total, grad, overwrite in targets(self.optimizer, window, grads):
            if overwrite:
                keep_maximum(total, grad, step)
                continue
            grad = scaled(grad, step.weight, total.dtype)
            _branch(
                step.opens,
                functools.partial(self._overwrite, total, grad),
                functools.partial(self._add_one, total, grad),
            )

    def _overwrite(self, total, grad):
        """`total = grad` (zero for `None`)."""
        if grad is None or isinstance(grad, tf.IndexedSlices):
            total.assign(tf.zeros_like(total.value))
        if isinstance(grad, tf.IndexedSlices):
            self.optimizer.assign_add(total, grad)
        elif grad is not None:
            total.assign(tf.cast(grad, total.dtype))

    def _add_one(self, total, grad):
        """`total += grad` (nothing for `None`)."""
        if grad is not None:
            self.optimizer.assign_add(total, grad)


def sums_of_squares(tensors):
    tensors = [
        tf.cast(_entries(t), "float32") for t in tensors if t is not None
    ]
    if not tensors:
        return tf.zeros((0,), "float32")
    # XLA first: an eager micro-step asks no device list.
    if _keras_private.in_xla_context() and _on_cpu():
        return tf.stack([_xla_cpu_sum_of_squares(t) for t in tensors])
    # `L2Loss` is one kernel without a temporary, where a square then a sum
    # are two and a buffer the size of the tensor.
    return tf.stack([2.0 * tf.nn.l2_loss(t) for t in tensors])


def _on_cpu():
    return not tf.config.list_logical_devices("GPU")


def _xla_cpu_sum_of_squares(tensor):
    """The squares apart, then their sum: XLA's CPU backend reduces a
    tensor in a vectorized loop, but with the squares fused into it in a
    scalar one, several times slower than the buffer of squares costs. In
    rows of `_ROW` first where they divide it: a float32 sum of a few
    long vectorized runs loses more bits than one of rows. A tensor of
    dynamic shape (an embedding's merged rows) is summed fused: XLA's
    barrier does not take one."""
    if not tensor.shape.is_fully_defined():
        return tf.reduce_sum(tf.square(tensor))
    squares = _keras_private.xla_unfused(tf.square(tf.reshape(tensor, [-1])))
    size = squares.shape[0]
    if size is not None and size > _ROW and size % _ROW == 0:
        squares = tf.reduce_sum(tf.reshape(squares, [-1, _ROW]), axis=1)
    return tf.reduce_sum(squares)


_ROW = 1024


def colocate(optimizer, reference):
    if reference is None:
        return contextlib.nullcontext()
    strategy = _keras_private.distribution_strategy(optimizer)
    return strategy.extended.colocate_vars_with(
        getattr(reference, "value", reference)
    )


def outside_compiled_code():
    return tf.init_scope()


def replica_count(optimizer):
    # The optimizer's strategy, which Keras' losses divide by
    # (`scale_loss_for_distribution`): also where `flush` runs outside its
    # scope, the window's variables are its.
    return _keras_private.distribution_strategy(optimizer).num_replicas_in_sync


def train_step_loss():
    # Only a Keras wrapper met inside its first step (a `MultiOptimizer`
    # mapped by a function names its optimizers there) scaled `fit`'s loss
    # without handing it on: its value, unscaled as that `scale_loss` did.
    found = _keras_private.tensorflow_train_step_loss()
    if found is None:
        return None
    model, loss = found
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = optimizer.initial_scale  # it was unbuilt: built in this step
    elif _keras_private.is_multi_optimizer(optimizer):
        scale = optimizer.loss_scale_factor
    else:
        return None
    return loss if scale is None else tf.divide(loss, scale)


def zero_weight_allowed():
    # A replica whose shard of the micro-batch is empty weighs 0.
    replica_context = tf.distribute.get_replica_context()
    return (
        replica_context is not None and replica_context.num_replicas_in_sync > 1
    )


assign = base.assign
kept_loss = base.kept_loss


def _after(grads):
    """Context in which the counters change only once every one of `grads`
    exists. In a graph each sum's add runs as soon as its gradient exists,
    while the backward pass computes the others: a step that fails in it
    may have written some sums, but no counter, and no weight (the close
    waits for the count, `_after_count`). `fit_to_memory` reads the count
    to tell a step whose update may have begun (`_recovery.py`)."""
    if tf.executing_eagerly():
        return contextlib.nullcontext()
    return tf.control_dependencies(
        [_entries(g) for g in grads if g is not None]
    )


def _after_count(window):
    """Context in which the window's close begins only once this step's
    count of micro-batches is written."""
    if tf.executing_eagerly():
        return contextlib.nullcontext()
    # A read of a variable runs after the writes built before it.
    return tf.control_dependencies([tf.identity(window.micro_batches.value)])


def _entries(grad):
    """A gradient's entries: an `IndexedSlices`' values, or itself."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _dense(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


def _merged_rows(grad):
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    rows, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(
        grad.values, positions, tf.shape(rows)[0]
    )
    return tf.IndexedSlices(values, rows, grad.dense_shape)


def _branch(pred, true_fn, false_fn):
    """`tf.cond` in a graph, a Python `if` eagerly."""
    if not tf.executing_eagerly():

        def returning(fn):
            # A branch must return something; both, the same.
            return lambda: (fn(), tf.constant(True))[1]

        tf.cond(pred, returning(true_fn), returning(false_fn))
    elif bool(pred):
        true_fn()
    else:
        false_fn()


def _once_if(pred, fn, sums):
    """Under XLA: runs `fn()`, which reads `sums` (the window's sum
    variables), only when `pred` is true, as a `tf.while_loop` of zero or
    one trip; a loop that does not run copies nothing. The sums pass
    through a barrier with the loop's count as the loop begins, so that
    XLA hoists nothing `fn` computes from them (the window's norm) out of
    the loop onto every call."""
    if isinstance(pred, bool):
        if pred:
            fn()
        return

    def body(trips):
        trips, *values = _keras_private.xla_barrier(
            trips, *[total.value for total in sums]
        )
        for total, value in zip(sums, values):
            total.assign(value)
        fn()
        return (trips + 1,)

    tf.while_loop(
        lambda trips: trips < tf.cast(pred, "int32"),
        body,
        (tf.constant(0),),
        maximum_iterations=1,
    )


def _run_in_each_replica_if(pred, fn):
    """Runs `fn` in each replica when `pred` is true, from cross-replica
    context: Keras' update calls `merge_call`, which cannot run inside a
    control-flow branch built in replica context (keras-team/keras#20582);
    as Keras' `LossScaleOptimizer` does."""
    if tf.executing_eagerly():
        if bool(pred):
            fn()
        return

    def in_cross_replica_context(distribution, pred):
        # Every replica counted the same micro-steps: take the first's.
        first_pred = distribution.experimental_local_results(pred)[0]

        def run():
            distribution.extended.call_for_each_replica(fn)
            return tf.constant(True)

        tf.cond(first_pred, run, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(
        in_cross_replica_context, args=(pred,)
    )
