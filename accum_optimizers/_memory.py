"""Device memory for `fit_to_memory`: each backend's out-of-memory error,
what a failed step leaves to free, and a train step's peak (XLA's memory
analysis of the compiled step on JAX, the allocator's peak on a GPU)."""

import gc
import re

import keras
import numpy as np
from keras import backend
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers._window.counts import regroup_window

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def memory_limit_bytes(value):
    """`value` in bytes (an int), or `None`."""
    if value is None:
        return None
    number = value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", value)
        unit = match and _UNITS.get(match.group(2).lower())
        number = unit and float(match.group(1)) * unit
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float, np.number))
        or not np.isfinite(number)
        or number < 1
    ):
        raise ValueError(
            "`memory_limit` must be a number of bytes >= 1 (an int, or a "
            "string such as '12GiB' or '500MB'). Received: "
            f"memory_limit={value!r}"
        )
    return int(number)


def format_bytes(count):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def is_out_of_memory(error):
    """Whether `error` is the backend's out-of-memory error: TensorFlow's
    `ResourceExhaustedError`, a JAX runtime error with status
    `RESOURCE_EXHAUSTED`, or torch's `OutOfMemoryError`."""
    name = backend.backend()
    if name == "tensorflow":
        import tensorflow as tf

        return isinstance(error, tf.errors.ResourceExhaustedError)
    if name == "jax":
        import jax

        return isinstance(error, jax.errors.JaxRuntimeError) and (
            "RESOURCE_EXHAUSTED" in str(error)
        )
    if name == "torch":
        import torch

        return isinstance(error, torch.OutOfMemoryError)
    return False


def free_memory(model):
    """Drops what a failed step held: its traced functions and the
    allocator's cached blocks."""
    model.train_function = None
    gc.collect()
    if backend.backend() == "jax":
        import jax

        jax.clear_caches()
    elif backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _state_variables(model):
    return (
        list(model.trainable_variables)
        + list(model.non_trainable_variables)
        + list(model.optimizer.variables)
        + list(model.metrics_variables)
    )


def probe(model, optimizers, batch):
    """`(fits, peak_bytes)` of one train step on `batch`: the window's last
    micro-step, run from the state copied to the host, and put back."""
    variables = _state_variables(model)
    saved = [np.array(ops.convert_to_numpy(v.value)) for v in variables]
    for optimizer in optimizers:
        if optimizer._accumulates:
            regroup_window(optimizer, optimizer.accum_iters - 1)
    _reset_peak()
    fits = True
    try:
        model.train_on_batch(*batch)
        peak = _allocator_peak()
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        fits, peak = False, None
    finally:
        for variable, value in zip(variables, saved):
            variable.assign(value)
        _keras_private.forget_jax_state(model)
    if not fits:
        free_memory(model)
    elif backend.backend() == "jax":
        peak = compiled_peak(model, batch)
    return fits, peak


def _gpu():
    if backend.backend() == "torch":
        import torch

        return torch.cuda.is_available()
    if backend.backend() == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_logical_devices("GPU"))
    return False


def _reset_peak():
    if not _gpu():
        return
    if backend.backend() == "torch":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats("GPU:0")


def _allocator_peak():
    """The allocator's peak since `_reset_peak` on a GPU, else `None`."""
    if not _gpu():
        return None
    if backend.backend() == "torch":
        import torch

        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    import tensorflow as tf

    return int(tf.config.experimental.get_memory_info("GPU:0")["peak"])


def compiled_peak(model, batch):
    """Peak bytes of Keras' JAX train step on `batch`'s shapes, compiled as
    `fit` compiles it (state donated), from XLA's memory analysis:
    arguments + outputs - aliased + temporaries. Nothing runs."""
    import jax

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
