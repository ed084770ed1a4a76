"""Private Keras APIs of the trainer side: the loss reductions
`weigh_micro_batches` records, the `fit` internals `fit_to_memory` uses, and
the global random state `check_exactness` puts back. Part of
`_keras_private` (its docstring lists what each is for); import them from
there."""

import contextlib
import dataclasses
import threading
from typing import Any

import keras

from accum_optimizers import _inputs

# -- `weigh_micro_batches` (weighting.py) ------------------------------------
#
# Keras' `Loss.__call__` reduces through the module function
# `keras.src.losses.loss.reduce_weighted_values(values, sample_weight, mask,
# reduction, dtype)`, the one place where the count a loss is divided by is
# known (its values after the loss function, the mask Keras derives from
# the predictions and the loss values, the sample weights it got), for any
# Keras loss a `compute_loss` computes, compiled or its own. Keras hands it
# to nothing else, and the trainers hand the optimizer only gradients. So
# `recorded_loss_reductions` puts a wrapper in its place, only while a
# recording runs in some thread (the first recording installs it, the last
# to end puts Keras' function back); it records each call's arguments in a
# thread that records (`_inputs.record_loss_reductions`), and passes every
# call through to Keras' function unchanged. `weighting.py` reads the
# count from them, with Keras' own `apply_mask` and
# `squeeze_or_expand_to_same_rank`.

LOSS_MODULE_FUNCTIONS = (
    "reduce_weighted_values",
    "apply_mask",
    "squeeze_or_expand_to_same_rank",
    "standardize_reduction",
)

# Of a model (the ones `weigh_micro_batches` and `FlushAccumulation` use
# are `objects.MODEL_ATTRIBUTES`); on JAX, after a `fit` step, also
# `JAX_TRAINER_ATTRIBUTES`.
TRAINER_ATTRIBUTES = (
    "_flatten_layers",
    "_symbolic_build",
    "_compile_config",
)
JAX_TRAINER_ATTRIBUTES = ("_jax_state", "_jax_state_synced")


def sublayers(layer):
    """Every layer inside `layer`, as Keras tracks them: in nested models
    and in custom layers' attributes (`Layer._flatten_layers`)."""
    return layer._flatten_layers(include_self=False, recursive=True)


@dataclasses.dataclass(eq=False)
class LossReduction:
    """The arguments of one `reduce_weighted_values` call (tensors: compared
    by identity)."""

    values: Any
    sample_weight: Any
    mask: Any
    reduction: str
    dtype: Any


def loss_module():
    from keras.src.losses import loss

    return loss


@contextlib.contextmanager
def recorded_loss_reductions():
    """Context that yields the list of `LossReduction`s of the Keras losses
    computed inside it, in this thread."""
    module = loss_module()
    _start_recording(module)
    try:
        with _inputs.record_loss_reductions() as records:
            yield records
    finally:
        _stop_recording(module)


# How many recordings run (in all threads), and Keras' function while they
# do: a thread that is not recording passes through the wrapper meanwhile.
_RECORDINGS = {"count": 0, "keras": None, "wrapper": None}
_RECORDINGS_LOCK = threading.Lock()


def _start_recording(module):
    with _RECORDINGS_LOCK:
        if _RECORDINGS["count"] == 0:
            original = module.reduce_weighted_values
            wrapper = _recording(original)
            _RECORDINGS.update(keras=original, wrapper=wrapper)
            module.reduce_weighted_values = wrapper
        _RECORDINGS["count"] += 1


def _stop_recording(module):
    with _RECORDINGS_LOCK:
        _RECORDINGS["count"] -= 1
        if _RECORDINGS["count"] == 0:
            # Where another library wrapped ours since, it is left to it
            # (ours passes through).
            if module.reduce_weighted_values is _RECORDINGS["wrapper"]:
                module.reduce_weighted_values = _RECORDINGS["keras"]
            _RECORDINGS.update(keras=None, wrapper=None)


def _recording(reduce_weighted_values):
    """`reduce_weighted_values` that adds its arguments, as a
    `LossReduction`, to this thread's recording, if any."""

    def recording(
        values,
        sample_weight=None,
        mask=None,
        reduction="sum_over_batch_size",
        dtype=None,
    ):
        records = _inputs.loss_reductions_recording()
        # A wrapper left inside another library's records no more.
        if records is not None and _RECORDINGS["wrapper"] is recording:
            records.append(
                LossReduction(values, sample_weight, mask, reduction, dtype)
            )
        return reduce_weighted_values(
            values,
            sample_weight=sample_weight,
            mask=mask,
            reduction=reduction,
            dtype=dtype,
        )

    return recording


# -- Trainer internals used by `fit_to_memory` (`memory_fit.py`) -------------
#
# `Trainer._symbolic_build(data_batch=...)`: builds the model, its compiled
# loss and metrics, and the optimizer from one batch, without a step (what
# `train_on_batch` runs first). JAX's trainer: `fit` takes the state off
# the variables before a step when `_jax_state_synced` is true, and on an
# error puts `_jax_state` back on them (`jax_state_sync`).


def symbolic_build(model, data_batch):
    """Builds `model` (layers, loss, metrics, optimizer) from
    `data_batch`, a `(x, y, sample_weight)` tuple, as `fit` would."""
    model._symbolic_build(data_batch=data_batch)


def jax_fit_takes_state_from_variables(model):
    """JAX: whether `fit`'s next step takes the state off the variables."""
    return bool(getattr(model, "_jax_state_synced", False))


def set_jax_state_to_variables(model):
    """JAX: makes the state `fit` puts back on an error the variables'."""
    model._jax_state = {
        "trainable_variables": [v.value for v in model.trainable_variables],
        "non_trainable_variables": [
            v.value for v in model.non_trainable_variables
        ],
        "optimizer_variables": [v.value for v in model.optimizer.variables],
        "metrics_variables": [v.value for v in model.metrics_variables],
    }


def forget_jax_state(model):
    """JAX: drops the state a `train_on_batch` or `fit` left on the model:
    a step that failed leaves an older one there, which the next `fit`
    puts back on the variables if its first step fails, or a callback
    syncs."""
    if hasattr(model, "_jax_state"):
        model._jax_state = None
        model._jax_state_synced = True


# -- Global random state (`check_exactness`, check/_runs.py) -------------------
#
# `keras.random` functions called without a `seed` draw from one global
# `SeedGenerator`, kept in Keras' global state under
# "global_seed_generator" (made on first use, dropped by `clear_session` and
# `set_random_seed`). The check builds models, which draws from it; it puts
# the generator and its state back afterwards.

GLOBAL_SEED_GENERATOR = "global_seed_generator"


def global_seed_generator_state():
    """`(generator, state)`: Keras' global `SeedGenerator` (or `None`) and a
    numpy copy of its state (or `None`)."""
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    if generator is None:
        return None, None
    return generator, keras.ops.convert_to_numpy(generator.state.value).copy()


def restore_global_seed_generator(saved):
    """Puts back what `global_seed_generator_state` returned."""
    from keras.src.backend.common import global_state

    generator, state = saved
    global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, generator)
    if generator is not None:
        generator.state.assign(state)


def is_functional(model):
    """Whether `model` is a Functional model (`keras.Model(inputs,
    outputs)`, or a subclass of it whose constructor takes those
    arguments), which `keras.models.clone_model` rebuilds layer by layer
    as its own class."""
    from keras.src.models.functional import Functional
    from keras.src.models.functional import functional_like_constructor

    return isinstance(model, Functional) and functional_like_constructor(
        type(model)
    )


def compiled_loss_weights(model):
    """The `loss_weights` argument `model` was compiled with (or `None`),
    as given: `Trainer._compile_config.config` holds `compile`'s arguments
    unserialized (`get_compile_config` serializes them all, and fails on a
    lambda loss)."""
    compile_config = getattr(model, "_compile_config", None)
    if compile_config is None:
        return None
    return compile_config.config.get("loss_weights")
