"""The backend's accumulation class, chosen once at import as Keras chooses
its backend optimizer class (`keras/src/optimizers/optimizer.py`), and its
`outside_compiled_code` context for the wrappers' own variables."""

from keras import backend

if backend.backend() == "tensorflow":
    from accum_optimizers._backend.tensorflow import (
        TFAccumulation as BackendAccumulation,
    )
elif backend.backend() == "jax":
    from accum_optimizers._backend.jax import (
        JaxAccumulation as BackendAccumulation,
    )
elif backend.backend() == "torch":
    from accum_optimizers._backend.torch import (
        TorchAccumulation as BackendAccumulation,
    )
else:
    raise ImportError(
        "accum_optimizers supports the Keras backends 'tensorflow', 'jax' "
        f"and 'torch'. Received: KERAS_BACKEND={backend.backend()!r}"
    )

# The backend's context for assignments that run once, now, even while a
# compiled function is traced: for variables that are not an accumulating
# optimizer's (a `LossScaleOptimizer`'s loss scale, restored in `build`).
outside_compiled_code = BackendAccumulation._accum_outside_compiled_code

__all__ = ["BackendAccumulation", "outside_compiled_code"]
