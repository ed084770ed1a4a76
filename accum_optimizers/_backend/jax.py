"""JAX: the window's update runs inside a loop that runs zero times or once.

Inside `jax.jit` (Keras' `stateless_apply`), `update_switch` is a tracer.
Keras' own accumulation computes the whole update every micro-step and
selects the result with `lax.cond`. Here the update runs in the body of a
`lax.while_loop` that runs zero times or once, so XLA executes the update
math only on the window's last micro-step. A loop rather than `lax.cond`:
XLA copies every array a conditional returns on every call, taken or not
(docs/benchmarks.md has the figures).
"""

import contextlib

import jax
import jax.numpy as jnp
import keras
from keras import StatelessScope

from accum_optimizers import _keras_private
from accum_optimizers._backend.base import Accumulation
from accum_optimizers._validation import MIN_WEIGHT


class JaxAccumulation(Accumulation):
    def _accum_note_loss(self, loss):
        # `fit` differentiates the function that computes the loss: its
        # value exists only outside it, in the train step.
        return

    def _accum_loss_outside_apply(self):
        return _keras_private.jax_train_step_loss()

    def _accum_check_traced_weight(self, weight):
        # Compiled code cannot raise without a host callback, which costs
        # every micro-step even when it never fires: an invalid weight makes
        # the window's gradients NaN instead, which `flush` discards and
        # `TerminateOnNaN` stops on.
        valid = jnp.logical_and(jnp.isfinite(weight), weight >= MIN_WEIGHT)
        return jnp.where(valid, weight, jnp.nan), contextlib.nullcontext()

    def _accum_run_if(self, pred, fn):
        if not _keras_private.is_jax_tracer(pred):
            return super()._accum_run_if(pred, fn)

        state = list(self._trainable_variables) + self.variables

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

    def _accum_store_means(self, sums, means):
        # Inside the window's loop the sums are loop-carried buffers: a
        # mean written back into its sum's buffer takes no memory of its
        # own, where XLA would otherwise hold every mean at once beside the
        # sums (a second parameter-sized buffer).
        for total, mean in zip(sums, means):
            total.assign(mean)
        return [total.value for total in sums]


# What the rest of the package asks of the backend, outside the window
# (the same names in every backend module; `_backend/__init__.py` exports
# the chosen backend's).

# XLA's memory analysis gives a step's peak without running it
# (`compiled_peak`).
SUPPORTS_MEMORY_ANALYSIS = True

# `iterations` changes with the rest of the step's state.
COUNTS_ITERATIONS_BEFORE_UPDATE = False

# A compiled step returns its whole new state or raises: a step that fails
# wrote none of it.
FAILED_STEP_WRITES_NO_STATE = True

# torch's compiler alone retraces per micro-batch (`weigh_micro_batches`).
COMPILER_RETRACES_EACH_HAND_OVER = False

# Gradients are dense arrays.
EMBEDDING_GRADIENTS_ARE_SPARSE = False

# `jax.distribution` reduces once per window on its own.
NEEDS_WINDOW_SYNC = False


def is_out_of_memory(error):
    """Whether `error` is a JAX runtime error with status
    `RESOURCE_EXHAUSTED`.

    Args:
        error: an exception.
    """
    return isinstance(error, jax.errors.JaxRuntimeError) and (
        "RESOURCE_EXHAUSTED" in str(error)
    )


def free_device_memory():
    """Frees the device memory a failed step held: JAX's compiled
    functions and what they cache."""
    jax.clear_caches()


def reset_allocator_peak():
    """Nothing: JAX's peak is `compiled_peak`'s, not the allocator's."""


def allocator_peak():
    """`None`: JAX's peak is `compiled_peak`'s, not the allocator's."""
    return None


def compiled_peak(model, batch):
    """Peak bytes of Keras' JAX train step on `batch`'s shapes, compiled as
    `fit` compiles it (state donated), from XLA's memory analysis:
    arguments + outputs - aliased + temporaries. Nothing runs.

    Args:
        model: a compiled `keras.Model`.
        batch: the train step's data: a structure of arrays (or `None`).
    """
    state = tuple(
        [v.value for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    shapes = keras.tree.map_structure(
        lambda leaf: (
            None
            if leaf is None
            else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        ),
        batch,
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    analysis = step.lower(state, shapes).compile().memory_analysis()
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def asserted_normalizer(weight, skips, message):
    """`None`: compiled code cannot fail, so `weigh_micro_batches` makes an
    invalid weight NaN instead of asserting.

    Args:
        weight: the micro-batch's traced loss normalizer.
        skips: whether a non-finite `weight` marks a micro-batch to skip.
        message: the assertion's message.
    """
    return None


def random_state():
    """The backend's own global random state beside Keras': `None`."""
    return None


def set_random_state(state):
    """Puts back `random_state()`'s state: there is none.

    Args:
        state: what `random_state()` returned.
    """


def quiet_python_logger():
    """Nothing: only TensorFlow's Python logger is quieted."""
