"""JAX pieces of the accumulation mechanism (see `__init__`).

Inside `jax.jit` (Keras' `stateless_apply`), `pred` is a tracer. Keras' own
accumulation then computes the whole update every micro-step and selects the
result with `lax.cond`. Here the update runs *inside* the body of a
`lax.while_loop` that runs zero times or once: the body opens a nested
`StatelessScope` seeded with the current values of every model and optimizer
variable, runs `fn`, and returns the values `fn` assigned. XLA executes the
update only on the window's last micro-step.

The gate is a loop rather than a `lax.cond` for the reason the TensorFlow
gate is (`_backend/tensorflow.py`): XLA copies every array a conditional
returns on every call, taken or not. Measured by `python -m
benchmarks.jax_gate` (four 1.3 M-float arrays, donated state, ms, not taken
/ taken): add-only 0.32 / 0.34, `lax.cond` 0.82 / 1.55, the loop
0.33 / 1.93, update every step 1.70 / 1.69.

The window's end does not zero the accumulators: writing zeros into arrays
the loop body also reads makes XLA copy each of them first, which cost as
much as the update (MLP, Adam: the window's last micro-step took 4.0 ms
against the parent's 3.0). `end_window` zeroes the counter only, and
the next window's first micro-step overwrites them (a select in the same
elementwise pass as the add): 3.1 ms (`python -m benchmarks.window_steps`).
Between windows the accumulators therefore hold the last window's sums; the
optimizer saves them as the zeros they stand for. The add runs on every
micro-step, before the gate, fused by XLA with the window's mean.
"""

import contextlib

import jax
import jax.numpy as jnp
from keras import StatelessScope
from keras import ops


def fused_parent(parent):
    return parent


def colocate_with(optimizer, variable):
    return contextlib.nullcontext()


def accumulate(
    optimizer, accumulators, grads, micro_steps, update_switch, apply_window
):
    _add_into(accumulators, grads, new_window=micro_steps == 1)
    run_if(
        optimizer,
        update_switch,
        lambda: apply_window([a.value for a in accumulators]),
    )


def _add_into(accumulators, grads, new_window):
    for accumulator, grad in zip(accumulators, grads):
        if grad is None:
            grad = jnp.zeros(accumulator.shape, accumulator.dtype)
            total = accumulator.value
        else:
            grad = jnp.asarray(grad).astype(accumulator.dtype)
            total = accumulator.value + grad
        accumulator.assign(jnp.where(new_window, grad, total))


def sum_over_replicas(values):
    return values


def window_mean(totals, micro_steps):
    return [ops.divide(t, ops.cast(micro_steps, t.dtype)) for t in totals]


def end_window(optimizer):
    optimizer._micro_steps.assign(ops.zeros((), optimizer._micro_steps.dtype))


def run_if(optimizer, pred, fn):
    if not isinstance(pred, jax.core.Tracer):
        if bool(pred):
            fn()
        return

    state = list(optimizer._trainable_variables) + optimizer.variables

    def taken(values):
        with StatelessScope(state_mapping=list(zip(state, values))) as scope:
            fn()
        return [scope.get_current_value(v) for v in state]

    # Zero trips or one: the carried flag is `pred`, and the body clears it.
    _, values = jax.lax.while_loop(
        lambda carry: carry[0],
        lambda carry: (jnp.asarray(False), taken(carry[1])),
        (jnp.asarray(pred, bool), [v.value for v in state]),
    )
    for variable, value in zip(state, values):
        variable.assign(value)
