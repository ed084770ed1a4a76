"""torch's answers to what `_backend/__init__.py` exports."""

import torch

from accum_optimizers._backend import runtime_defaults

# XLA's memory analysis of a step is JAX's alone (`compiled_peak`).
SUPPORTS_MEMORY_ANALYSIS = False

# `iterations` changes in the step's update, after its gradients.
COUNTS_ITERATIONS_BEFORE_UPDATE = False

# An eager step that fails may have written part of its state.
FAILED_STEP_WRITES_NO_STATE = False

# `apply` counts the micro-batch before it adds the gradients, which the
# backward pass computed before it.
FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS = False

# torch.compile (`jit_compile=True`) recompiles the train step for every
# micro-batch's hand-over, up to its recompile limit.
COMPILER_RETRACES_EACH_HAND_OVER = True

# Gradients are dense tensors.
EMBEDDING_GRADIENTS_ARE_SPARSE = False

# Under DDP every backward all-reduces, unless `sync_windows` defers it.
NEEDS_WINDOW_SYNC = True


def is_out_of_memory(error):
    """Whether `error` is torch's `OutOfMemoryError`.

    Args:
        error: an exception.
    """
    return isinstance(error, torch.OutOfMemoryError)


def free_device_memory():
    """Frees the device memory a failed step held: the CUDA allocator's
    cached blocks, if there is a GPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_allocator_peak():
    """Restarts the CUDA allocator's peak, if there is a GPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def allocator_peak():
    """The CUDA allocator's peak in bytes since `reset_allocator_peak`, or
    `None` without a GPU."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def random_state():
    """torch's global random state (`torch.random`), beside Keras' seed
    generator's."""
    return torch.random.get_rng_state()


def set_random_state(state):
    """Puts back `random_state()`'s state.

    Args:
        state: what `random_state()` returned.
    """
    torch.random.set_rng_state(state)


# What this backend has nothing to give for.
compiled_peak = runtime_defaults.compiled_peak
asserted_normalizer = runtime_defaults.asserted_normalizer
quiet_python_logger = runtime_defaults.quiet_python_logger
