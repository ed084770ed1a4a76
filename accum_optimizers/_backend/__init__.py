"""The backend's accumulation class, chosen once at import as Keras chooses
its backend optimizer class (`keras/src/optimizers/optimizer.py`)."""

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

__all__ = ["BackendAccumulation"]
