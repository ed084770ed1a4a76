"""TensorFlow: how a micro-step is arranged depends on how the graph runs.

`arrangement()` names the four ways, chosen once per micro-step:

- Eagerly, or in a plain graph (`tf.function` without XLA, no `merge_call`
  strategy): each gradient goes into its sum by a `tf.cond` of its own,
  then `tf.cond(update_switch, window)` applies the sums. TensorFlow runs a
  function's side effects once all its inputs exist: a branch that took
  every gradient would hold them all until the backward pass ended, where
  the parent frees each as it applies it.
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
  are all-reduced once, inside the window. The gradients go into the sums
  by one branch each, as in a plain graph.

The window's end zeroes only the counter; the next window's first
micro-step overwrites the sums (`assign(grad)` hands the gradient's buffer
to the variable, cheaper than zeroing into a fresh buffer).
"""

import contextlib
import functools

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

    @staticmethod
    def _accum_outside_compiled_code():
        return tf.init_scope()

    def _accum_after(self, grads):
        if tf.executing_eagerly():
            return super()._accum_after(grads)
        # Every gradient depends on the step's data: one suffices. Only
        # scalar counters wait for it (see `_accum_take_micro_step`).
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
            self._accum_add_each(sums, grads, new_window, weight)
            _run_in_each_replica_if(
                update_switch, lambda: apply_window([s.value for s in sums])
            )
        else:
            self._accum_add_each(sums, grads, new_window, weight)
            _branch(
                update_switch,
                lambda: apply_window([s.value for s in sums]),
                lambda: None,
            )

    def _accum_run_if(self, pred, fn):
        if arrangement() == XLA:
            _run_at_most_once(pred, fn)
        else:
            _branch(pred, fn, lambda: None)

    def _accum_add_each(self, sums, grads, new_window, weight):
        """Eagerly or in a graph without XLA: each gradient goes into its sum
        by a branch of its own, overwriting it on a new window, else adding
        (scattering `IndexedSlices` instead of densifying them).

        One branch per gradient: TensorFlow runs a function's side effects
        once all its inputs exist, so a branch taking every gradient would
        hold them all until the backward pass ends, where the parent frees
        each as soon as it is applied.
        """
        grads = self._accum_weighed(sums, grads, weight)
        for total, grad in zip(sums, grads):
            _branch(
                new_window,
                functools.partial(self._accum_overwrite, total, grad),
                functools.partial(self._accum_add_one, total, grad),
            )

    def _accum_overwrite(self, total, grad):
        """`total = grad` (zero for `None`)."""
        if grad is None or isinstance(grad, tf.IndexedSlices):
            total.assign(tf.zeros_like(total.value))
        if isinstance(grad, tf.IndexedSlices):
            self.assign_add(total, grad)
        elif grad is not None:
            total.assign(tf.cast(grad, total.dtype))

    def _accum_add_one(self, total, grad):
        """`total += grad` (nothing for `None`)."""
        if grad is not None:
            self.assign_add(total, grad)

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

    def _accum_sums_of_squares(self, grads):
        # An embedding's `IndexedSlices` may repeat a row: the rows are
        # merged first (a buffer the size of the slices, not of the
        # table), so that the squares are the dense gradient's.
        merged = []
        for grad in grads:
            if isinstance(grad, tf.IndexedSlices):
                rows, positions = tf.unique(grad.indices)
                values = tf.math.unsorted_segment_sum(
                    grad.values, positions, tf.shape(rows)[0]
                )
                grad = tf.IndexedSlices(values, rows, grad.dense_shape)
            merged.append(grad)
        return super()._accum_sums_of_squares(merged)

    def _accum_replicas(self):
        # The optimizer's strategy, which Keras' losses divide by
        # (`scale_loss_for_distribution`): also where `flush` runs outside
        # its scope, the window's variables are its.
        return self._distribution_strategy.num_replicas_in_sync

    def _accum_samples_in(self, total_weight):
        # The close divides by the replicas' mean total weight, as their
        # gradients arrive divided by R. A window of micro-batches counts
        # global micro-batches, one per step: that mean. A weighted one
        # counts each replica's samples: their sum.
        if self._accum_counts_weights:
            return total_weight * float(self._accum_replicas())
        return total_weight

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

    def _accum_reduce_window(self, sums, extras, total_weight):
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
        # One all-reduce for the sums, the extras and the weight together.
        reduced = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, pinned)
        replicas = tf.cast(replica_context.num_replicas_in_sync, "float32")
        return (
            reduced[: len(sums)],
            reduced[len(sums) : -1],
            reduced[-1] / replicas,
        )

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
        if not self._has_window:
            return super()._all_reduce_sum_gradients(grads_and_vars)
        return grads_and_vars


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
