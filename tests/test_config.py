"""Construction: arguments, validation, Keras 2 spellings, get_config."""

import warnings

import keras
import numpy as np
import pytest
from helpers import PARENTS

from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import schedules

CLASSES = list(PARENTS)


@pytest.mark.parametrize("cls", CLASSES)
def test_subclasses_its_keras_parent(cls):
    assert isinstance(cls(accum_iters=2), PARENTS[cls])


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "bad, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (2.5, TypeError),
        (4.0, TypeError),
        ("4", TypeError),
        (True, TypeError),
        (None, TypeError),
    ],
)
def test_bad_accum_iters_is_refused_naming_argument_and_value(cls, bad, error):
    with pytest.raises(error, match=rf"accum_iters.*{bad!r}"):
        cls(accum_iters=bad)


@pytest.mark.backends("torch")
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("accum_iters", [1, 4])
def test_torch_keeps_keras_fused_parallel_update_step(cls, accum_iters):
    from keras.src.backend.torch.optimizers.torch_parallel_optimizer import (
        TorchParallelOptimizer,
    )

    optimizer = cls(accum_iters=accum_iters)
    assert isinstance(optimizer, TorchParallelOptimizer)


@pytest.mark.parametrize("cls", CLASSES)
def test_numpy_integer_accum_iters_is_accepted(cls):
    assert cls(accum_iters=np.int64(3)).accum_iters == 3


@pytest.mark.parametrize("cls", CLASSES)
def test_double_accumulation_is_refused(cls):
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        cls(accum_iters=4, gradient_accumulation_steps=2)


def test_keras_accumulation_alone_still_works_with_accum_iters_1():
    optimizer = AdamAccumulate(gradient_accumulation_steps=2)
    assert optimizer.gradient_accumulation_steps == 2


@pytest.mark.parametrize("bad", ["int8", "int32", "bool"])
def test_non_float_accumulator_dtype_is_refused(bad):
    with pytest.raises(ValueError, match=f"accumulator_dtype.*{bad}"):
        AdamAccumulate(accum_iters=2, accumulator_dtype=bad)


@pytest.mark.parametrize("bad", [-1e-5, "0.1", True])
def test_bad_decay_is_refused(bad):
    with pytest.raises(ValueError, match=f"decay={bad!r}"):
        AdamAccumulate(decay=bad)


def test_old_recipe_call_runs_with_deprecation_warnings():
    with pytest.warns(DeprecationWarning) as record:
        optimizer = AdamAccumulate(lr=0.001, decay=1e-5, accum_iters=5)
    messages = " ".join(str(w.message) for w in record)
    assert "learning_rate" in messages and "InverseTimeDecay" in messages
    assert optimizer.accum_iters == 5 and optimizer.decay == 1e-5
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(optimizer.learning_rate), 0.001
    )


def test_lr_and_a_different_learning_rate_conflict():
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match="learning_rate=0.5, lr=0.1"):
            SGDAccumulate(learning_rate=0.5, lr=0.1)


@pytest.mark.parametrize("accum_iters", [1, 3])
def test_keras2_decay_divides_by_one_plus_decay_times_updates(accum_iters):
    # Hand-computed: SGD step t (0-based) moves by lr / (1 + decay * t) * g.
    with pytest.warns(DeprecationWarning):
        optimizer = SGDAccumulate(lr=0.1, decay=0.5, accum_iters=accum_iters)
    variable = keras.Variable(0.0)
    for _ in range(3 * accum_iters):
        optimizer.apply_gradients([(keras.ops.ones(()), variable)])
    expected = -0.1 * (1 / 1 + 1 / 1.5 + 1 / 2.0)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("cls", [AdamAccumulate, RMSpropAccumulate])
def test_epsilon_none_means_keras_default_epsilon(cls):
    assert cls(epsilon=None).epsilon == keras.config.epsilon()


def test_no_warning_for_plain_construction():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdamAccumulate(accum_iters=2)


CONFIGS = [
    (
        AdamAccumulate,
        dict(
            learning_rate=0.5,
            beta_1=0.5,
            beta_2=0.67,
            epsilon=1e-5,
            amsgrad=True,
            weight_decay=0.01,
            clipnorm=1.0,
            use_ema=True,
            ema_momentum=0.9,
            ema_overwrite_frequency=3,
            loss_scale_factor=128.0,
            accumulator_dtype="float32",
        ),
    ),
    (
        SGDAccumulate,
        dict(learning_rate=0.5, momentum=0.06, nesterov=True, clipvalue=0.1),
    ),
    (
        RMSpropAccumulate,
        dict(
            learning_rate=0.5,
            rho=0.8,
            momentum=0.3,
            epsilon=1e-4,
            centered=True,
            global_clipnorm=2.0,
        ),
    ),
]


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_get_config_round_trips_every_argument(cls, kwargs):
    optimizer = cls(accum_iters=7, name="opt", **kwargs)
    config = optimizer.get_config()
    assert config["accum_iters"] == 7
    for key, value in kwargs.items():
        assert config[key] == pytest.approx(value), key
    restored = cls.from_config(config)
    assert type(restored) is cls
    assert restored.get_config() == config


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_keras_serialization_round_trips_without_custom_objects(cls, kwargs):
    optimizer = cls(accum_iters=3, **kwargs)
    serialized = keras.optimizers.serialize(optimizer)
    restored = keras.optimizers.deserialize(serialized)
    assert type(restored) is cls
    assert restored.get_config() == optimizer.get_config()


def test_schedule_learning_rate_round_trips():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = AdamAccumulate(learning_rate=schedule, accum_iters=2)
    restored = AdamAccumulate.from_config(optimizer.get_config())
    assert restored.get_config() == optimizer.get_config()


# -- Numbers: every real number type, never a bool ----------------------------

INTEGER_TYPES = [int, np.int8, np.uint16, np.int32, np.int64]
NUMBER_TYPES = INTEGER_TYPES + [float, np.float16, np.float32, np.float64]


def _by_noise_scale(**arguments):
    return schedules.by_noise_scale(**{"micro_batch_size": 8, **arguments})


def _quietly(make):
    """`make`, without the Keras 2 spelling's deprecation warning."""

    def made(value):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return make(value)

    return made


# name: (make an object from the value, the value it keeps, a valid value
# for integer types, one for floating types (`None`: integers only)).
NUMERIC_ARGUMENTS = {
    "accum_iters": (
        lambda v: AdamAccumulate(accum_iters=v),
        lambda o: o.accum_iters,
        3,
        None,
    ),
    "noise_scale_momentum": (
        lambda v: AdamAccumulate(noise_scale_momentum=v),
        lambda o: o.noise_scale_momentum,
        0,
        0.5,
    ),
    "decay": (
        _quietly(lambda v: SGDAccumulate(decay=v)),
        lambda o: o.decay,
        2,
        0.25,
    ),
    "micro_batch_size": (
        lambda v: _by_noise_scale(micro_batch_size=v),
        lambda o: o.micro_batch_size,
        16,
        0.5,
    ),
    "floor": (lambda v: _by_noise_scale(floor=v), lambda o: o.floor, 3, None),
    "ceiling": (
        lambda v: _by_noise_scale(ceiling=v),
        lambda o: o.ceiling,
        9,
        None,
    ),
    "warmup_windows": (
        lambda v: _by_noise_scale(warmup_windows=v),
        lambda o: o.warmup_windows,
        4,
        None,
    ),
    "ramp_updates": (
        lambda v: schedules.LinearRamp(1, 4, ramp_updates=v),
        lambda o: o.ramp_updates,
        10,
        None,
    ),
    "batch_size": (
        lambda v: AccumulationLogger(batch_size=v),
        lambda o: o.batch_size,
        32,
        None,
    ),
    "update_freq": (
        lambda v: AccumulationLogger(update_freq=v),
        lambda o: o.update_freq,
        5,
        None,
    ),
}


@pytest.mark.parametrize(
    "name, kind",
    [
        (name, kind)
        for name, (*_, float_value) in NUMERIC_ARGUMENTS.items()
        for kind in (INTEGER_TYPES if float_value is None else NUMBER_TYPES)
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_a_numeric_argument_takes_every_real_number_type(name, kind):
    # "Number > 0" in the docs covers numpy scalars (tuners draw them); the
    # kept value is a Python number, which configs and JSON hold.
    make, read, int_value, float_value = NUMERIC_ARGUMENTS[name]
    integer = np.issubdtype(kind, np.integer) or kind is int
    value = int_value if integer else float_value
    kept = read(make(kind(value)))
    assert kept == value and type(kept) in (int, float), (kept, type(kept))


@pytest.mark.parametrize("bad", [True, np.True_], ids=repr)
@pytest.mark.parametrize("name", sorted(NUMERIC_ARGUMENTS))
def test_a_numeric_argument_refuses_a_bool_naming_it(name, bad):
    make = NUMERIC_ARGUMENTS[name][0]
    with pytest.raises((TypeError, ValueError), match=f"{name}={bad!r}"):
        make(bad)
