"""Every optimizer Keras ships, and a user's own, accumulates exactly.

Oracle: the parent Keras class, built on its own copy of the variables,
applying each window's mean gradient once."""

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import assert_same_weights
from helpers import parent_class
from helpers import parent_on_window_means
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from modes import MODES
from modes import applier

import accum_optimizers
from accum_optimizers import accumulating

tensor = keras.ops.convert_to_tensor

# Optimizers that wrap others, where the installed Keras has them
# (`MultiOptimizer` arrived in Keras 3.15).
WRAPPERS = tuple(
    getattr(keras.optimizers, name)
    for name in ("LossScaleOptimizer", "MultiOptimizer")
    if hasattr(keras.optimizers, name)
)

# The optimizers the installed Keras ships, read from `keras.optimizers`:
# Keras 3.15 ships Adadelta ... SGD and ScheduleFreeAdamW.
KERAS_OPTIMIZERS = tuple(
    sorted(
        name
        for name, value in vars(keras.optimizers).items()
        if isinstance(value, type)
        and issubclass(value, keras.optimizers.Optimizer)
        and value is not keras.optimizers.Optimizer
        and not issubclass(value, WRAPPERS)
    )
)

# Every Keras since 3.10, the oldest supported, ships these.
SINCE_KERAS_3_10 = (
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "Lamb",
    "Lion",
    "Muon",
    "Nadam",
    "RMSprop",
    "SGD",
)

# A 2-D kernel (Muon's Newton-Schulz path, Adafactor's factored path), a
# bias (Muon's Adam path) and an embedding table (excluded by Muon).
VARIABLES = {"kernel": (4, 3), "bias": (3,), "embedding": (5, 2)}

common_options = st.fixed_dictionaries(
    {},
    optional={
        "weight_decay": st.sampled_from([0.01, 0.1]),
        "clipnorm": st.sampled_from([0.1, 1.0]),
        "global_clipnorm": st.just(0.5),
        "use_ema": st.just(True),
    },
).filter(lambda o: not ("clipnorm" in o and "global_clipnorm" in o))


def test_every_optimizer_keras_exports_has_an_accumulating_class():
    assert set(SINCE_KERAS_3_10) <= set(KERAS_OPTIMIZERS)
    for name in KERAS_OPTIMIZERS:
        assert f"{name}Accumulate" in accum_optimizers.__all__
        cls = getattr(accum_optimizers, f"{name}Accumulate")
        assert parent_class(cls) is getattr(keras.optimizers, name)


def _variables():
    rng = np.random.default_rng(0)
    return [
        keras.Variable(rng.normal(size=shape).astype("float32"), name=name)
        for name, shape in VARIABLES.items()
    ]


def _check_against_parent(parent_cls, options, accum_iters, windows, step):
    """Runs `windows` through `step` (ours) and the parent's `apply`."""
    ours_vars, parent_vars = step.variables, _variables()
    for window in windows:
        for grads in window:
            step(grads)
    parent = parent_cls(**options)
    parent_on_window_means(parent, parent_vars, windows)
    assert_all_close(
        ours_vars, parent_vars, rtol=1e-4, atol=1e-6, what="variable"
    )
    assert_all_close(
        step.optimizer.variables[: len(parent.variables)],
        parent.variables,
        rtol=1e-4,
        atol=1e-6,
        what="optimizer variable",
    )
    assert int(step.optimizer.iterations) == len(windows)


def _windows(seed, accum_iters, count):
    rng = np.random.default_rng(seed)
    return [
        [
            [
                rng.normal(size=shape).astype("float32")
                for shape in VARIABLES.values()
            ]
            for _ in range(accum_iters)
        ]
        for _ in range(count)
    ]


def _step(optimizer, mode="eager"):
    variables = _variables()
    apply = applier(optimizer, variables, mode)

    def step(grads):
        apply([tensor(g) for g in grads])

    step.variables, step.optimizer = variables, optimizer
    return step


@pytest.mark.parametrize("name", KERAS_OPTIMIZERS)
# A sixth of the profile's examples per optimizer (2 in CI, 33 with
# HYPOTHESIS_PROFILE=thorough): 14 optimizers share the budget.
@settings(max_examples=max(2, settings.default.max_examples // 6))
@given(
    options=common_options,
    accum_iters=st.integers(2, 4),
    count=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_every_keras_optimizer_equals_its_parent_on_window_means(
    name, options, accum_iters, count, seed
):
    keras.backend.clear_session(free_memory=False)
    parent_cls = getattr(keras.optimizers, name)
    cls = getattr(accum_optimizers, f"{name}Accumulate")
    optimizer = cls(accum_iters=accum_iters, **options)
    _check_against_parent(
        parent_cls,
        options,
        accum_iters,
        _windows(seed, accum_iters, count),
        _step(optimizer),
    )


@pytest.mark.parametrize("mode", [m for m in MODES if m != "eager"])
@pytest.mark.parametrize("name", KERAS_OPTIMIZERS)
def test_every_keras_optimizer_accumulates_in_compiled_code(name, mode):
    parent_cls = getattr(keras.optimizers, name)
    cls = getattr(accum_optimizers, f"{name}Accumulate")
    options = {"weight_decay": 0.01}
    _check_against_parent(
        parent_cls,
        options,
        3,
        _windows(1, 3, 2),
        _step(cls(accum_iters=3, **options), mode),
    )


@pytest.mark.parametrize("name", KERAS_OPTIMIZERS)
def test_accum_iters_1_is_the_parent(name):
    parent_cls = getattr(keras.optimizers, name)
    cls = getattr(accum_optimizers, f"{name}Accumulate")
    optimizer = cls()
    _check_against_parent(
        parent_cls, {}, 1, _windows(2, 1, 3), _step(optimizer)
    )
    assert len(optimizer.variables) == len(_built(parent_cls()).variables)


def _built(optimizer):
    optimizer.build(_variables())
    return optimizer


@pytest.mark.parametrize("name", KERAS_OPTIMIZERS)
def test_every_class_takes_parent_arguments_in_the_parents_order(name):
    parent_cls = getattr(keras.optimizers, name)
    cls = getattr(accum_optimizers, f"{name}Accumulate")
    assert cls.__name__ == f"{name}Accumulate"
    assert issubclass(cls, parent_cls)
    optimizer = cls(0.125, accum_iters=4)
    assert float(optimizer.learning_rate) == 0.125
    config = optimizer.get_config()
    assert config["accum_iters"] == 4
    restored = cls.from_config(config)
    assert restored.get_config() == config
    assert accumulating(parent_cls) is cls
    assert accumulating(cls) is cls


@pytest.mark.parametrize("name", KERAS_OPTIMIZERS)
def test_every_class_saves_and_resumes_mid_window(name, tmp_path):
    cls = getattr(accum_optimizers, f"{name}Accumulate")
    calls = [g for window in _windows(3, 3, 2) for g in window]
    uninterrupted = _model(cls(accum_iters=3))
    _run(uninterrupted, calls)

    interrupted = _model(cls(accum_iters=3))
    _run(interrupted, calls[:4])
    path = tmp_path / "model.keras"
    interrupted.save(path)
    restored = keras.saving.load_model(path)
    assert type(restored.optimizer) is cls
    assert int(restored.optimizer.micro_steps) == 1
    _run(restored, calls[4:])
    assert_same_weights(restored, uninterrupted, rtol=1e-6, atol=1e-7)


def _model(optimizer):
    """A compiled model whose weights are `VARIABLES`, so that `.keras`
    files carry the optimizer's state."""
    model = keras.Sequential([keras.Input((1,)), _Holder()])
    model.compile(optimizer=optimizer, loss="mse")
    for variable, value in zip(model.trainable_variables, _variables()):
        variable.assign(value)
    return model


def _run(model, calls):
    apply = applier(model.optimizer, model.trainable_variables, "eager")
    for grads in calls:
        apply([tensor(g) for g in grads])


@keras.saving.register_keras_serializable(package="tests")
class _Holder(keras.layers.Layer):
    def build(self, input_shape):
        for name, shape in VARIABLES.items():
            setattr(self, name, self.add_weight(shape=shape, name=name))

    def call(self, x):
        return x
