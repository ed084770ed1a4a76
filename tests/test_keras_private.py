"""Every private Keras API listed in `_keras_private` still exists, so a
Keras upgrade that moves one fails here, by name, not deep in a window."""

import importlib

import keras
import pytest

import accum_optimizers
from accum_optimizers import _keras_private

BACKEND = keras.backend.backend()


@pytest.mark.parametrize("name", _keras_private.OPTIMIZER_ATTRIBUTES)
def test_optimizer_private_attribute_exists(name):
    optimizer = keras.optimizers.Adam()
    optimizer.build([keras.Variable([1.0])])
    assert hasattr(optimizer, name), name


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("name", _keras_private.TENSORFLOW_OPTIMIZER_ATTRIBUTES)
def test_tensorflow_optimizer_private_attribute_exists(name):
    assert hasattr(keras.optimizers.Adam(), name), name


@pytest.mark.backends("tensorflow")
def test_tensorflow_internals_answer_outside_a_graph():
    assert _keras_private.in_xla_context() is False
    assert _keras_private.strategy_needs_merge_call() is False


# The optimizers Keras 3.15 swaps for a fused (`torch._foreach_*`) variant
# on torch, each in `keras/src/backend/torch/optimizers/torch_<name>.py`.
TORCH_FUSED = (
    "Adadelta",
    "Adagrad",
    "Adam",
    "Adamax",
    "AdamW",
    "Lion",
    "Nadam",
    "RMSprop",
    "SGD",
)


@pytest.mark.parametrize("name", TORCH_FUSED + ("Lamb", "Muon"))
def test_fused_class_is_what_keras_instantiates(name):
    parent = getattr(keras.optimizers, name)
    if BACKEND == "torch" and name in TORCH_FUSED:
        module = importlib.import_module(
            f"keras.src.backend.torch.optimizers.torch_{name.lower()}"
        )
        expected = getattr(module, name)
        assert expected is not parent
    else:
        expected = parent
    assert type(parent()) is expected
    assert _keras_private.fused_class(parent) is expected
    # The accumulating class is itself, and builds on what Keras runs.
    ours = getattr(accum_optimizers, f"{name}Accumulate")
    assert type(ours()) is ours
    assert expected in ours.__mro__ and parent in ours.__mro__


@pytest.mark.parametrize("name", _keras_private.LOSS_MODULE_FUNCTIONS)
def test_loss_module_function_exists(name):
    assert callable(getattr(_keras_private.loss_module(), name, None)), name


@pytest.mark.parametrize("name", _keras_private.TRAINER_ATTRIBUTES)
def test_trainer_private_attribute_exists(name):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert hasattr(model, name), name


def test_recorded_loss_reductions_see_keras_losses_and_restore_them():
    module = _keras_private.loss_module()
    original = module.reduce_weighted_values
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    with _keras_private.recorded_loss_reductions() as records:
        loss(keras.ops.ones((3, 2)), keras.ops.zeros((3, 2)), [1.0, 2.0, 0.5])
    assert module.reduce_weighted_values is original
    assert [r.reduction for r in records] == ["mean_with_sample_weight"]
    assert tuple(records[0].values.shape) == (3,)
