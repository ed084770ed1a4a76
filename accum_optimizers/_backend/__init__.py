"""The backend's window (`WindowBackend`, see `base.py`) and the facts of
its environment, chosen once at import as Keras chooses its backend
optimizer class (`keras/src/optimizers/optimizer.py`); and what the rest of
the package asks of the backend (device memory, random state, what a
failed step leaves), chosen once alike: the modules outside `_backend/`
call these and name no backend."""

from keras import backend

if backend.backend() == "tensorflow":
    from accum_optimizers._backend import tensorflow as _window
    from accum_optimizers._backend import tensorflow_runtime as _chosen
elif backend.backend() == "jax":
    from accum_optimizers._backend import jax as _window
    from accum_optimizers._backend import jax_runtime as _chosen
elif backend.backend() == "torch":
    from accum_optimizers._backend import torch as _window
    from accum_optimizers._backend import torch_runtime as _chosen
else:
    raise ImportError(
        "accum_optimizers supports the Keras backends 'tensorflow', 'jax' "
        f"and 'torch'. Received: KERAS_BACKEND={backend.backend()!r}"
    )

# The window's hooks, and its environment (documented in `base.py`).
WindowBackend = _window.WindowBackend
assign = _window.assign
colocate = _window.colocate
outside_compiled_code = _window.outside_compiled_code
replica_count = _window.replica_count
zero_weight_allowed = _window.zero_weight_allowed
sums_of_squares = _window.sums_of_squares
kept_loss = _window.kept_loss
train_step_loss = _window.train_step_loss

# Each is documented in every `*_runtime.py`, which defines them all.
SUPPORTS_MEMORY_ANALYSIS = _chosen.SUPPORTS_MEMORY_ANALYSIS
COUNTS_ITERATIONS_BEFORE_UPDATE = _chosen.COUNTS_ITERATIONS_BEFORE_UPDATE
FAILED_STEP_WRITES_NO_STATE = _chosen.FAILED_STEP_WRITES_NO_STATE
FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS = (
    _chosen.FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS
)
COMPILER_RETRACES_EACH_HAND_OVER = _chosen.COMPILER_RETRACES_EACH_HAND_OVER
EMBEDDING_GRADIENTS_ARE_SPARSE = _chosen.EMBEDDING_GRADIENTS_ARE_SPARSE
NEEDS_WINDOW_SYNC = _chosen.NEEDS_WINDOW_SYNC
is_out_of_memory = _chosen.is_out_of_memory
free_device_memory = _chosen.free_device_memory
reset_allocator_peak = _chosen.reset_allocator_peak
allocator_peak = _chosen.allocator_peak
compiled_peak = _chosen.compiled_peak
asserted_normalizer = _chosen.asserted_normalizer
random_state = _chosen.random_state
set_random_state = _chosen.set_random_state
quiet_python_logger = _chosen.quiet_python_logger

__all__ = [
    "COMPILER_RETRACES_EACH_HAND_OVER",
    "COUNTS_ITERATIONS_BEFORE_UPDATE",
    "EMBEDDING_GRADIENTS_ARE_SPARSE",
    "FAILED_STEP_MAY_LEAVE_UNCOUNTED_SUMS",
    "FAILED_STEP_WRITES_NO_STATE",
    "NEEDS_WINDOW_SYNC",
    "SUPPORTS_MEMORY_ANALYSIS",
    "WindowBackend",
    "allocator_peak",
    "assign",
    "asserted_normalizer",
    "colocate",
    "compiled_peak",
    "free_device_memory",
    "is_out_of_memory",
    "kept_loss",
    "outside_compiled_code",
    "quiet_python_logger",
    "random_state",
    "replica_count",
    "reset_allocator_peak",
    "set_random_state",
    "sums_of_squares",
    "train_step_loss",
    "zero_weight_allowed",
]
