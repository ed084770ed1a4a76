"""TensorFlow pieces of the accumulation mechanism (see `__init__`).

How a micro-step is arranged depends on how the graph runs:

- In a plain graph (`tf.function` without XLA, and a strategy that needs no
  `merge_call`), one `tf.cond(update_switch, window, add)`: the window's last
  micro-step applies `(accumulators + grads) / micro_steps` without writing
  the accumulators, the others add into them. Each variable's update then
  waits only for its own gradient, so the executor overlaps it with the rest
  of the backward pass, as it does for the parent optimizer; adding first
  and gating after made the update wait for every add (MLP, RMSprop, the
  window's last micro-step: 5.39 ms against 5.93, Keras' built-in 5.50,
  `python -m benchmarks.window_steps`).
- Under XLA (`jit_compile=True`), add on every micro-step, then a gate that
  is a `tf.while_loop` running zero times or once, not a `tf.cond`: a
  conditional whose branch writes variables copies every variable it
  touches on every call, taken or not (measured: 1.9 ms per call for four
  1.3 M-float variables, more than the Adam update it skips); the loop
  updates them in place and its not-taken path costs what an add-only step
  costs.
- Under a `tf.distribute` strategy that synchronizes replicas with
  `merge_call` (every strategy on CPU, and without XLA on GPU), the window's
  update calls `merge_call` (Keras updates mirrored variables there), and
  `merge_call` cannot run inside a control-flow branch built in replica
  context (keras-team/keras#20582). There each replica adds into its own
  replica-local accumulators, then the gate is a `tf.cond` built in
  cross-replica context whose branch runs the window in each replica with
  `call_for_each_replica`, as Keras' `LossScaleOptimizer` does;
  `sum_over_replicas` all-reduces the accumulators once, inside the window.

The window's end zeroes only the counter; the next window's first micro-step
overwrites the accumulators. Without XLA that is `accumulator.assign(grad)`,
which hands the gradient's buffer to the variable, where zeroing had
`assign(zeros)` give it a fresh buffer that made the next `assign_add` cost
0.23 ms more (MLP, SGD, `tf.function`: mean `apply` 1.37 -> 1.22 ms, Keras'
built-in 1.32). Under XLA it is one `where` fused into the add, as on JAX.
"""

import contextlib

import tensorflow as tf
from keras import ops
from tensorflow.python.ops import control_flow_util


def fused_parent(parent):
    return parent


def colocate_with(optimizer, variable):
    """Places a new optimizer variable with its model variable, if any."""
    if variable is None:
        return contextlib.nullcontext()
    return optimizer._distribution_strategy.extended.colocate_vars_with(
        getattr(variable, "value", variable)
    )


def accumulate(
    optimizer, accumulators, grads, micro_steps, update_switch, apply_window
):
    new_window = tf.equal(micro_steps, 1)
    if _in_xla_context() or _needs_merge_call():
        # Add, then the gate (see the module docstring).
        _add_into(optimizer, accumulators, grads, new_window)
        run_if(
            optimizer,
            update_switch,
            lambda: apply_window([a.value for a in accumulators]),
        )
        return

    # One branch: the window's last micro-step applies accumulators + grads
    # without writing them, the others add.
    def window():
        apply_window(
            [_plus(a.value, grad) for a, grad in zip(accumulators, grads)]
        )
        return tf.constant(True)

    def add():
        _add_into(optimizer, accumulators, grads, new_window)
        return tf.constant(False)

    _branch(update_switch, window, add)


def _plus(total, grad):
    if grad is None:
        return total
    if isinstance(grad, tf.IndexedSlices):
        return tf.tensor_scatter_nd_add(
            total,
            tf.expand_dims(grad.indices, -1),
            tf.cast(grad.values, total.dtype),
        )
    return total + tf.cast(grad, total.dtype)


def _add_into(optimizer, accumulators, grads, new_window):
    """`accumulator += grad`, or `= grad` on a window's first micro-step."""
    if _in_xla_context():
        # One select fused into the add; XLA densifies `IndexedSlices`.
        for accumulator, grad in zip(accumulators, grads):
            if grad is None:
                grad = tf.zeros_like(accumulator.value)
                total = accumulator.value
            else:
                grad = tf.cast(tf.convert_to_tensor(grad), accumulator.dtype)
                total = accumulator.value + grad
            accumulator.assign(tf.where(new_window, grad, total))
        return

    def overwrite():
        for accumulator, grad in zip(accumulators, grads):
            if grad is None or isinstance(grad, tf.IndexedSlices):
                accumulator.assign(tf.zeros_like(accumulator.value))
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                optimizer.assign_add(accumulator, grad)
            else:
                accumulator.assign(grad)
        return tf.constant(True)

    def add():
        # `optimizer.assign_add` scatters `tf.IndexedSlices` (embedding
        # gradients) instead of densifying them.
        for accumulator, grad in zip(accumulators, grads):
            if grad is not None:
                optimizer.assign_add(accumulator, grad)
        return tf.constant(False)

    _branch(new_window, overwrite, add)


def _branch(pred, true_fn, false_fn):
    """`tf.cond` in a graph, a Python `if` eagerly."""
    if not tf.executing_eagerly():
        tf.cond(pred, true_fn, false_fn)
    elif bool(pred):
        true_fn()
    else:
        false_fn()


def _in_xla_context():
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def sum_over_replicas(values):
    """`values`, summed over the replicas of a strategy."""
    replica_context = tf.distribute.get_replica_context()
    if (
        not values
        or replica_context is None
        or replica_context.num_replicas_in_sync == 1
    ):
        return values
    pinned = []
    for value in values:
        # Pin each value to its replica's device: inside a control-flow
        # branch, MultiWorkerMirroredStrategy leaves ops without one, and
        # the all-reduce needs it.
        with tf.device(value.device):
            pinned.append(tf.identity(value))
    return replica_context.all_reduce(tf.distribute.ReduceOp.SUM, pinned)


def window_mean(totals, micro_steps):
    """`totals / micro_steps`, as a multiply by the reciprocal.

    TensorFlow divides by a variable with an elementwise `RealDiv`, where
    Grappler turns Keras' built-in's constant divisor into a multiply (MLP,
    one window: 0.59 against 0.18 ms of op time in a `tf.profiler` trace).
    """
    reciprocals = {}
    means = []
    for total in totals:
        if total.dtype not in reciprocals:
            reciprocals[total.dtype] = tf.math.reciprocal(
                tf.cast(micro_steps, total.dtype)
            )
        means.append(total * reciprocals[total.dtype])
    return means


def end_window(optimizer):
    micro_steps = optimizer._micro_steps
    micro_steps.assign(ops.zeros(micro_steps.shape, micro_steps.dtype))


def run_if(optimizer, pred, fn):
    if tf.executing_eagerly():
        if bool(pred):
            fn()
        return
    if not _needs_merge_call():
        _run_at_most_once(pred, fn)
        return
    replica_context = tf.distribute.get_replica_context()

    def in_cross_replica_context(distribution, pred):
        # Every replica counted the same micro-steps: take the first's.
        first_pred = distribution.experimental_local_results(pred)[0]

        def run():
            distribution.extended.call_for_each_replica(fn)
            return tf.constant(True)

        tf.cond(first_pred, run, lambda: tf.constant(False))

    replica_context.merge_call(in_cross_replica_context, args=(pred,))


def _needs_merge_call():
    """Whether Keras' update will call `merge_call` (see the docstring)."""
    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
        and not tf.__internal__.distribute.strategy_supports_no_merge_call()
    )


def _run_at_most_once(pred, fn):
    def body(trips):
        fn()
        return trips + 1

    tf.while_loop(
        lambda trips: trips < tf.cast(pred, tf.int32),
        body,
        [tf.constant(0)],
        maximum_iterations=1,
    )
