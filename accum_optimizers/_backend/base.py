"""The window's backend interface, with the defaults most backends use.

The accumulating optimizer computes a micro-step as a value
(`_window/transition.py`) and hands its writes to one object per
optimizer, a `WindowBackend`, through the hooks below. A backend
module (`tensorflow.py`, `jax.py`, `torch.py`) subclasses it where its
cheapest arrangement differs, as Keras' own `TFOptimizer`, `JaxOptimizer`
and `TorchOptimizer` override `BaseOptimizer`. Each backend module also
defines the facts of its environment the window needs (the functions at
the end of this module are the defaults).
"""

import contextlib

from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers._finite import all_finite
from accum_optimizers._finite import masked
from accum_optimizers._finite import sums_of_squares as _sums_of_squares


class WindowBackend:
    """How one optimizer's window runs on this backend.

    Args:
        optimizer: the accumulating optimizer it serves.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def begin(self, flushing=False):
        """Called first in every `apply` (and in `flush` of a pending
        window, with `flushing=True`), before anything is read."""

    def read_gradients(self, grads, squares, finite):
        """The one read of a micro-batch's gradients for the features:
        `(squares, finite)`: where `squares`, a float32 vector of each
        gradient's sum of squares (`sums_of_squares`); where `finite`,
        whether every entry is finite (a bool or a traced scalar bool);
        `None` for what is not asked."""
        sq = sums_of_squares(grads) if squares else None
        return sq, (all_finite(grads, squares=sq) if finite else None)

    def agree(self, flag):
        """`flag` (this replica's or rank's bool) and-ed over every replica
        or rank, so that they all take the same branch. Identity where
        programs see global arrays or there is one replica."""
        return flag

    def check_weight(self, weight):
        """`(weight, context)`: makes the call fail, before the writes that
        run in `context`, unless the traced float32 scalar `weight` is
        finite and `> 0`; where compiled code cannot fail, the weight
        returned is NaN instead, which makes the window's update NaN."""
        return weight, contextlib.nullcontext()

    def commit(self, window, step, grads, close):
        """Writes a micro-step: `step`'s counters (a `transition.Step`),
        then each gradient into its sum (`window.sums`, aligned with
        `grads`; `None` adds nothing) multiplied by `step.weight`,
        overwriting the sum on the window's first micro-step, nothing where
        `step.enters` is false; then runs `close()` where `step.closes`."""
        write_counters(window, step)
        add_into_sums(self.optimizer, window, step, grads)
        self.run_if(step.closes, close)

    def run_if(self, pred, fn):
        """Runs `fn()`, which assigns variables, only when `pred` is true,
        without computing its math otherwise."""
        if bool(pred):
            fn()

    def reduce_window(self, sums, extras, total_weight):
        """`(sums, extras, total_weight)`: the window's gradient `sums` and
        its other float32 tensors added over replicas, its total weight
        averaged over them, in one exchange. Identity where programs see
        global arrays or there is one replica."""
        return sums, extras, total_weight

    def mean(self, sums, totals, divisor):
        """The window's means `totals / divisor`, to hand to the parent's
        update; `sums` are the variables `totals` were read from, dead
        until the next window overwrites them, where a backend may keep
        the means."""
        return [ops.divide(t, ops.cast(divisor, t.dtype)) for t in totals]


def targets(optimizer, window, grads):
    """`(sum, grad, overwrite)` per variable: `overwrite` for float8
    scales, whose window keeps a maximum."""
    return [
        (total, grad, _keras_private.overwrites_with_gradient(optimizer, v))
        for total, grad, v in zip(
            window.sums, grads, _keras_private.trainable_variables(optimizer)
        )
    ]


def add_into_sums(optimizer, window, step, grads):
    """`commit`'s writes into the sums, in `keras.ops`: masked where
    `step.enters` may be false, the select fused into the add."""
    grads = [masked(g, step.enters) for g in grads]
    for total, grad, overwrite in targets(optimizer, window, grads):
        if overwrite:
            keep_maximum(total, grad, step)
        else:
            _add(total, scaled(grad, step.weight, total.dtype), step.opens)


def write_counters(window, step):
    """Assigns the window's counters as `step` computed them."""
    assign(counter_writes(window, step))


def counter_writes(window, step):
    """`(variable, value)`: the window's counters `step` writes."""
    writes = [
        (window.micro_steps, step.micro_steps),
        (window.micro_batches, step.micro_batches),
        (window.seen, step.seen),
        (window.total_weight, step.total_weight),
        (window.loss_sum, step.loss_sum),
    ]
    if step.skipped is not None:
        writes.append((window.skipped, step.skipped))
    if step.refused is not None:
        writes.append((window.refused, step.refused))
    if step.noise_sums is not None:
        writes += zip(
            (
                window.noise_sq_norm_sum,
                window.noise_inverse_weight_sum,
                window.noise_micro_batches,
            ),
            step.noise_sums,
        )
    return writes


def scaled(grad, weight, dtype):
    """`weight * grad` in `dtype` (a sum's), multiplied in float32 at
    least (a token count is not a bfloat16 number); `grad` for a `None`
    weight or gradient. An `IndexedSlices` stays one."""
    if weight is None or grad is None:
        return grad
    if hasattr(grad, "dense_shape"):
        values = scaled(grad.values, weight, dtype)
        return type(grad)(values, grad.indices, grad.dense_shape)
    wide = "float64" if dtype == "float64" else "float32"
    product = ops.multiply(ops.cast(grad, wide), ops.cast(weight, wide))
    return ops.cast(product, dtype)


def keep_maximum(total, grad, step):
    """float8 scale variables (`overwrite_with_gradient`): the window keeps
    the maximum of its "gradients", as the big batch computes. A window
    that opens without one starts from `-inf`: its maximum is that of the
    gradients it gets (one it gets none of is not updated)."""
    if grad is None:
        lowest = ops.full(total.shape, float("-inf"), total.dtype)
        if not isinstance(step.opens, bool):
            total.assign(ops.where(step.opens, lowest, total.value))
        elif step.opens:
            total.assign(lowest)
        return
    grad = ops.cast(grad, total.dtype)
    kept = ops.where(step.opens, grad, ops.maximum(total.value, grad))
    if step.enters is not None:
        kept = ops.where(step.enters, kept, total.value)
    total.assign(kept)


def _add(total, grad, opens):
    """`total += grad`, or `total = grad` (zero for `None`) where `opens`:
    one select fused into the add, under XLA cheaper than zeroing the sums
    in a pass of their own."""
    if grad is None:
        total.assign(ops.where(opens, ops.zeros_like(total.value), total.value))
        return
    grad = ops.cast(grad, total.dtype)
    total.assign(ops.where(opens, grad, ops.add(total.value, grad)))


# The environment's facts, for backends that have nothing to add.


def assign(writes):
    """Assigns each `(variable, value)` of `writes`, in order; `value` is
    a tensor or a number."""
    for variable, value in writes:
        variable.assign(value)


def sums_of_squares(tensors):
    """A float32 vector: the sum of squares of each of `tensors` (`None`s
    left out), in one read of each; the noise scale's micro-batch norms,
    skip's finiteness and the window's gradient norm."""
    return _sums_of_squares(tensors)


def colocate(optimizer, reference):
    """Context in which a new optimizer variable is placed with
    `reference` (a model variable, or `None`)."""
    return contextlib.nullcontext()


def outside_compiled_code():
    """Context in which assignments run once, now, even while a compiled
    function is being traced (restoring state in `build`)."""
    return contextlib.nullcontext()


def replica_count(optimizer):
    """The number of replicas `R` whose gradients each arrive divided by
    `R` and are added over them once per window (tf.distribute); 1 where
    programs see global arrays or each rank's gradients are its own mean
    (torch `sync_windows`)."""
    return 1


def zero_weight_allowed():
    """Whether a weight may be `0`: a replica's whose share of the
    micro-batch is empty."""
    return False


def kept_loss(loss):
    """What the optimizer keeps of the loss `scale_loss` receives, for its
    `apply`, or `None` where that loss is not the value (JAX
    differentiates it; `train_step_loss` reads it)."""
    return loss


def train_step_loss():
    """The micro-batch's loss where it reaches the optimizer neither as an
    argument nor through `scale_loss`, or `None`."""
    return None
