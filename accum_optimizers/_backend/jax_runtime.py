"""JAX's answers to what `_backend/__init__.py` exports."""

import jax
import keras

from accum_optimizers._backend import runtime_defaults

# XLA's memory analysis gives a step's peak without running it
# (`compiled_peak`).
SUPPORTS_MEMORY_ANALYSIS = True

# `iterations` changes with the rest of the step's state.
COUNTS_ITERATIONS_BEFORE_UPDATE = False

# A compiled step returns its whole new state or raises: a step that fails
# wrote none of it.
FAILED_STEP_WRITES_NO_STATE = True

# (All or none, above.)
FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS = False

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


# What this backend has nothing to give for.
asserted_normalizer = runtime_defaults.asserted_normalizer
random_state = runtime_defaults.random_state
set_random_state = runtime_defaults.set_random_state
quiet_python_logger = runtime_defaults.quiet_python_logger
