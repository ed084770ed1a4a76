"""JAX pieces of the accumulation mechanism (see `__init__`).

Inside `jax.jit` (Keras' `stateless_apply`), `pred` is a tracer. Keras' own
accumulation then computes the whole update every micro-step and selects the
result with `lax.cond`. Here the update runs *inside* the true branch of one
`lax.cond`: the branch opens a nested `StatelessScope` seeded with the
current values of every model and optimizer variable, runs `fn`, and returns
the values `fn` assigned. XLA executes only the branch that is taken.
"""

import contextlib

import jax
from keras import StatelessScope
from keras import ops


def fused_parent(parent):
    return parent


def colocate_with(optimizer, variable):
    return contextlib.nullcontext()


def add_into(optimizer, accumulators, grads):
    for accumulator, grad in zip(accumulators, grads):
        accumulator.assign(accumulator.value + grad.astype(accumulator.dtype))


def sum_over_replicas(variables):
    return [variable.value for variable in variables]


def zero(variables):
    for variable in variables:
        variable.assign(ops.zeros(variable.shape, variable.dtype))


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

    values = jax.lax.cond(
        pred, taken, lambda values: values, [v.value for v in state]
    )
    for variable, value in zip(state, values):
        variable.assign(value)
