"""Device memory for `fit_to_memory`: the memory limit, what a failed step
leaves to free, and a train step's peak (XLA's memory analysis of the
compiled step on JAX, the allocator's peak on a GPU), from the backend's
functions in `_backend/`."""

import gc
import re

import numpy as np
from keras import ops

from accum_optimizers import _keras_private
from accum_optimizers._backend import SUPPORTS_MEMORY_ANALYSIS
from accum_optimizers._backend import allocator_peak
from accum_optimizers._backend import compiled_peak
from accum_optimizers._backend import free_device_memory
from accum_optimizers._backend import is_out_of_memory
from accum_optimizers._backend import reset_allocator_peak
from accum_optimizers._validation import is_real_number
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
    if not is_real_number(number) or not np.isfinite(number) or number < 1:
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


def free_memory(model):
    """Drops what a failed step held: its traced functions and the
    device's cached memory.

    Args:
        model: the `keras.Model` whose step failed.
    """
    model.train_function = None
    gc.collect()
    free_device_memory()


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
        if optimizer._has_window:
            regroup_window(optimizer, optimizer.accum_iters - 1)
    reset_allocator_peak()
    fits = True
    try:
        model.train_on_batch(*batch)
        peak = allocator_peak()
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
    elif SUPPORTS_MEMORY_ANALYSIS:
        # XLA's analysis of the step as `fit` compiles it; JAX's allocator
        # reports no peak.
        peak = compiled_peak(model, batch)
    return fits, peak
