"""JAX: the window's close runs inside a loop that runs zero times or once.

Inside `jax.jit` (Keras' `stateless_apply`), `closes` is a tracer. Keras'
own accumulation computes the whole update every micro-step and selects
the result with `lax.cond`. Here the update runs in the body of a
`lax.while_loop` that runs zero times or once, so XLA executes the update
math only on the window's last micro-step. A loop rather than `lax.cond`:
XLA copies every array a conditional returns on every call, taken or not
(docs/benchmarks.md has the figures).
"""

import contextlib

import jax
import jax.numpy as jnp
from keras import StatelessScope

from accum_optimizers import _keras_private
from accum_optimizers._backend import base
from accum_optimizers._validation import MIN_WEIGHT


class WindowBackend(base.WindowBackend):
    def check_weight(self, weight):
        # Compiled code cannot raise without a host callback, which costs
        # every micro-step even when it never fires: an invalid weight makes
        # the window's gradients NaN instead, which `flush` discards and
        # `TerminateOnNaN` stops on.
        valid = jnp.logical_and(jnp.isfinite(weight), weight >= MIN_WEIGHT)
        return jnp.where(valid, weight, jnp.nan), contextlib.nullcontext()

    def run_if(self, pred, fn):
        if not _keras_private.is_jax_tracer(pred):
            return super().run_if(pred, fn)
        optimizer = self.optimizer
        variables = _keras_private.trainable_variables(optimizer)
        state = list(variables) + optimizer.variables

        def taken(values):
            # `fn` assigns variables; a nested stateless scope seeded with
            # the loop's carry collects what it assigned.
            mapping = list(zip(state, values))
            with StatelessScope(state_mapping=mapping) as scope:
                fn()
            return [scope.get_current_value(v) for v in state]

        # Zero trips or one: the carried flag is `pred`; the body clears it.
        _, values = jax.lax.while_loop(
            lambda carry: carry[0],
            lambda carry: (jnp.asarray(False), taken(carry[1])),
            (jnp.asarray(pred, bool), [v.value for v in state]),
        )
        for variable, value in zip(state, values):
            variable.assign(value)

    def mean(self, sums, totals, divisor):
        # Inside the close's loop the sums are loop-carried buffers: a mean
        # written back into its sum's buffer takes no memory of its own,
        # where XLA would otherwise hold every mean at once beside the sums.
        for total, mean in zip(sums, super().mean(sums, totals, divisor)):
            total.assign(mean)
        return [total.value for total in sums]


def kept_loss(loss):
    # `fit` differentiates the function that computes the loss: its value
    # exists only outside it, in the train step (`train_step_loss`).
    return None


def train_step_loss():
    return _keras_private.jax_train_step_loss()


assign = base.assign
colocate = base.colocate
outside_compiled_code = base.outside_compiled_code
replica_count = base.replica_count
zero_weight_allowed = base.zero_weight_allowed
sums_of_squares = base.sums_of_squares
