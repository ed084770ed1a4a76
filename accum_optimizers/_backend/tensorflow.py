"""TensorFlow: how a micro-step is arranged depends on how the graph runs.

`arrangement()` names the four ways, chosen once per micro-step:

- Eagerly, or in a plain graph (`tf.function` without XLA, no `merge_call`
  strategy): one `tf.cond(update_switch, window, add)`. The window's last
  micro-step applies `(sums + grads) / count` without writing the sums, so each
  variable's update waits only for its own gradient and overlaps the rest
  of the backward pass, as the parent optimizer's does.
- Under XLA: add on every micro-step, then a gate that is a `tf.while_loop`
  running zero times or once. A `tf.cond` whose branch writes variables
  makes XLA copy every variable it touches on every call, taken or not; the
  loop updates them in place.
- Under a strategy that synchronizes replicas with `merge_call` (every
  strategy on CPU, and without XLA on GPU): Keras updates mirrored
  variables in `merge_call`, which cannot run inside a control-flow branch
  built in replica context (keras-team/keras#20582). Each replica adds into
  its own replica-local sums; the gate is a `tf.cond` built in
  cross-replica context whose branch runs the window in each replica with
  `call_for_each_replica`, as Keras' `LossScaleOptimizer` does; the sums
  are all-reduced once, inside the window.

The window's end zeroes only the counter; the next window's first
micro-step overwrites the sums (`assign(grad)` hands the gradient's buffer
to the variable, cheaper than zeroing into a fresh buffer).
"""

import contextlib

import tensorflow as tf

from accum_optimizers import _keras_private
from accum_optimizers._backend.base import Accumulation
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


class TFAccumulation(Accumulation):
    def _accum_colocate(self, reference):
        if reference is None:
            return super()._accum_colocate(reference)
        return self._distribution_strategy.extended.colocate_vars_with(
            getattr(reference, "value", reference)
        )

    def _accum_outside_compiled_code(self):
        return tf.init_scope()

    def _accum_after(self, grads):
        if tf.executing_eagerly():
            return super()._accum_after(grads)
        # Every gradient depends on the step's data: one suffices, and the
        # last variable's is the first the backward pass computes, so the
        # counters wait the least.
        last = next(g for g in reversed(grads) if g is not None)
        if isinstance(last, tf.IndexedSlices):
            last = last.values
        return tf.control_dependencies([last])

    def _accum_micro_step(
        self, sums, grads, new_window, update_switch, apply_window, weight=None
    ):
        how = arrangement()
        if how == XLA:
            # XLA densifies `IndexedSlices`; the select fuses into the add.
            self._accum_add(sums, grads, new_window, weight)
            _run_at_most_once(
                update_switch, lambda: apply_window([s.value for s in sums])
            )
        elif how == MERGE_CALL:
            # tf.distribute cannot scatter into a replica-local variable:
            # an embedding's `IndexedSlices` is added densely.
            grads = [
                tf.convert_to_tensor(g)
                if isinstance(g, tf.IndexedSlices)
                else g
                for g in grads
            ]
            self._accum_add(sums, grads, new_window, weight)
            _run_in_each_replica_if(
                update_switch, lambda: apply_window([s.value for s in sums])
            )
        else:
            self._accum_branch(
                sums, grads, new_window, update_switch, apply_window, weight
            )

    def _accum_branch(
        self, sums, grads, new_window, update_switch, apply_window, weight
    ):
        """Eagerly or in a plain graph: the window's last micro-step applies
        `sums + grads` without writing the sums; the others add, scattering
        `IndexedSlices` (embedding gradients) instead of densifying them."""
        grads = self._accum_weighed(sums, grads, weight)
        # Only a window of 1 (`skip_nonfinite`, a schedule, samples
        # counted) closes on its first micro-step, where the sums still
        # hold the previous window's.
        first = new_window if self._accum_min_window_size == 1 else None

        def window():
            apply_window(
                [_plus(s.value, grad, first) for s, grad in zip(sums, grads)]
            )
            return tf.constant(True)

        def overwrite():
            for total, grad in zip(sums, grads):
                if grad is None or isinstance(grad, tf.IndexedSlices):
                    total.assign(tf.zeros_like(total.value))
                if grad is None:
                    continue
                if isinstance(grad, tf.IndexedSlices):
                    self.assign_add(total, grad)
                else:
                    total.assign(tf.cast(grad, total.dtype))
            return tf.constant(True)

        def add():
            for total, grad in zip(sums, grads):
                if grad is not None:
                    self.assign_add(total, grad)
            return tf.constant(False)

        def accumulate():
            _branch(new_window, overwrite, add)
            return tf.constant(False)

        _branch(update_switch, window, accumulate)

    def _accum_check_traced_weight(self, weight):
        if self._accum_zero_weight_allowed():
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

    def _accum_scale(self, grad, weight, dtype):
        if isinstance(grad, tf.IndexedSlices):
            values = super()._accum_scale(grad.values, weight, dtype)
            return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
        return super()._accum_scale(grad, weight, dtype)

    def _accum_zero_weight_allowed(self):
        # A replica whose shard of the micro-batch is empty weighs 0.
        replica_context = tf.distribute.get_replica_context()
        return (
            replica_context is not None
            and replica_context.num_replicas_in_sync > 1
        )

    def _accum_if_finite(self, finite, micro_step):
        if arrangement() != GRAPH:
            return super()._accum_if_finite(finite, micro_step)

        # In a plain graph a branch runs only when taken: no masking pass
        # over the gradients.
        def take():
            micro_step(None)
            return tf.constant(True)

        def skip():
            self._accum_skipped.assign_add(1)
            return tf.constant(False)

        tf.cond(finite, take, skip)

    def _accum_agree_finite(self, finite):
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None or replica_context.num_replicas_in_sync == 1:
            return finite
        # One scalar per micro-step: a replica's skip must be everyone's
        # (tf.distribute reduces by sum or mean only: count the others).
        nonfinite = replica_context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.cast(tf.logical_not(finite), "float32"),
        )
        return tf.equal(nonfinite, 0.0)

    def _accum_reduce_window(self, sums, total_weight):
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None or replica_context.num_replicas_in_sync == 1:
            return sums, total_weight
        pinned = []
        device = sums[0].device if sums else total_weight.device
        for value in sums + [total_weight]:
            # Inside a control-flow branch MultiWorkerMirroredStrategy
            # leaves ops without a device, and the all-reduce needs one.
            with tf.device(value.device or device):
                pinned.append(tf.identity(value))
        # One all-reduce for the sums and the weight together.
        reduced = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, pinned)
        replicas = tf.cast(replica_context.num_replicas_in_sync, "float32")
        return reduced[:-1], reduced[-1] / replicas

    def _accum_window_mean(self, totals, count):
        # A multiply by the reciprocal: TensorFlow divides by a variable
        # with an elementwise `RealDiv`, several times slower.
        reciprocals = {}
        means = []
        for total in totals:
            if total.dtype not in reciprocals:
                reciprocals[total.dtype] = tf.math.reciprocal(
                    tf.cast(count, total.dtype)
                )
            means.append(total * reciprocals[total.dtype])
        return means

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Keras' `TFOptimizer` all-reduces gradients here on every `apply`;
        # a window's sums are already all-reduced by
        # `_accum_reduce_window`, once per window.
        if not self._accumulates:
            return super()._all_reduce_sum_gradients(grads_and_vars)
        return grads_and_vars


def _plus(total, grad, new_window=None):
    """The window's total, `total + grad`; `grad` alone where `new_window`
    (a tensor, when given) is true."""
    if new_window is not None:
        total = tf.where(new_window, tf.zeros_like(total), total)
    if grad is None:
        return total
    if isinstance(grad, tf.IndexedSlices):
        return tf.tensor_scatter_nd_add(
            total,
            tf.expand_dims(grad.indices, -1),
            tf.cast(grad.values, total.dtype),
        )
    return total + tf.cast(grad, total.dtype)


def _branch(pred, true_fn, false_fn):
    """`tf.cond` in a graph, a Python `if` eagerly."""
    if not tf.executing_eagerly():
        tf.cond(pred, true_fn, false_fn)
    elif bool(pred):
        true_fn()
    else:
        false_fn()


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


def _run_at_most_once(pred, fn):
    """`if pred: fn()` as a loop of zero trips or one: under XLA a `tf.cond`
    whose branch writes variables copies every one of them on every call."""

    def body(trips):
        fn()
        return trips + 1

    tf.while_loop(
        lambda trips: trips < tf.cast(pred, tf.int32),
        body,
        [tf.constant(0)],
        maximum_iterations=1,
    )
