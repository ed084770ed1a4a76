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


# Arguments set as attributes after construction ---------------------------

# One bad value per checked argument, and what its error says.
_BAD_ATTRIBUTES = [
    ("accum_iters", 0, ValueError),
    ("skip_nonfinite", "yes", TypeError),
    ("measure_noise_scale", 1, TypeError),
    ("noise_scale_momentum", 1.0, ValueError),
    ("accumulator_dtype", "int32", ValueError),
    ("jit_compile", "no", TypeError),
    ("decay", -1.0, ValueError),
]


@pytest.mark.parametrize("accum_iters", [1, 2])
@pytest.mark.parametrize("name, bad, error", _BAD_ATTRIBUTES)
def test_an_attribute_set_is_checked_as_the_constructor_checks_it(
    name, bad, error, accum_iters
):
    optimizer = AdamAccumulate(accum_iters=accum_iters)
    before = getattr(optimizer, name)
    with pytest.raises(error, match=rf"{name}.*{bad!r}"):
        setattr(optimizer, name, bad)
    assert getattr(optimizer, name) == before
    # As the constructor refuses it.
    with pytest.raises(error, match=rf"{name}.*{bad!r}"):
        AdamAccumulate(**{name: bad})


@pytest.mark.parametrize(
    "name, value",
    [
        ("jit_compile", False),
        ("jit_compile", np.bool_(True)),
        ("noise_scale_momentum", 0.5),
        ("decay", 0.01),
        ("skip_nonfinite", True),
        ("accumulator_dtype", "float64"),
        ("accum_iters", {0: 2, 4: 3}),
    ],
)
@pytest.mark.filterwarnings("ignore:`decay`:DeprecationWarning")
def test_an_attribute_set_before_build_round_trips_the_config(name, value):
    optimizer = AdamAccumulate(accum_iters=2)
    setattr(optimizer, name, value)
    restored = AdamAccumulate.from_config(optimizer.get_config())
    assert getattr(restored, name) == getattr(optimizer, name)
    assert type(getattr(restored, name)) is type(getattr(optimizer, name))


def test_jit_compile_set_to_a_string_is_refused_before_saving(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=AdamAccumulate(accum_iters=2), loss="mse")
    with pytest.raises(TypeError, match="jit_compile='no'"):
        model.optimizer.jit_compile = "no"
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.jit_compile == "auto"


def _built(accum_iters=1, **kwargs):
    optimizer = AdamAccumulate(accum_iters=accum_iters, **kwargs)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    return optimizer


def test_skip_nonfinite_on_an_optimizer_built_without_a_window_is_refused():
    optimizer = _built()
    with pytest.raises(ValueError, match="skip_nonfinite=True"):
        optimizer.skip_nonfinite = True
    assert optimizer.skip_nonfinite is False
    optimizer.skip_nonfinite = False  # what it is: nothing to refuse


def test_skip_nonfinite_set_before_build_skips():
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = SGDAccumulate(0.1)
    optimizer.skip_nonfinite = True
    optimizer.apply([keras.ops.convert_to_tensor([np.nan, 1.0])], [variable])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), 1.0)
    assert int(optimizer.skipped_micro_batches) == 1


def test_accumulator_dtype_after_build_is_refused():
    optimizer = _built(accum_iters=2)
    with pytest.raises(ValueError, match="accumulator_dtype='float64'"):
        optimizer.accumulator_dtype = "float64"
    assert optimizer.accumulator_dtype is None
    optimizer.accumulator_dtype = None  # unchanged


def test_measure_noise_scale_off_under_a_noise_keyed_window_is_refused():
    optimizer = AdamAccumulate(
        accum_iters=schedules.by_noise_scale(4), measure_noise_scale=True
    )
    with pytest.raises(ValueError, match="measure_noise_scale=False"):
        optimizer.measure_noise_scale = False
    assert optimizer.measure_noise_scale is True


def test_accum_iters_beside_keras_accumulation_is_refused():
    optimizer = AdamAccumulate(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        optimizer.accum_iters = 3
    assert optimizer.accum_iters == 1


@pytest.mark.parametrize(
    "name, value",
    [
        ("jit_compile", False),
        ("decay", 0.5),
        ("noise_scale_momentum", 0.5),
        ("skip_nonfinite", True),
    ],
)
def test_a_traced_attribute_changed_after_build_warns(name, value):
    optimizer = _built(accum_iters=2)
    with pytest.warns(UserWarning, match=rf"`{name}`.*make_train_function"):
        setattr(optimizer, name, value)
    assert getattr(optimizer, name) == value


def test_lr_set_as_an_attribute_sets_learning_rate():
    optimizer = AdamAccumulate(0.1, accum_iters=2)
    with pytest.warns(DeprecationWarning, match="lr"):
        optimizer.lr = 0.5
    assert float(keras.ops.convert_to_numpy(optimizer.learning_rate)) == 0.5
    assert optimizer.lr is optimizer.learning_rate


def test_attributes_set_on_accum_iters_1_keep_the_parent_update():
    variable = keras.Variable(np.ones(2, "float32"))
    ours = AdamAccumulate(0.1)
    ours.jit_compile = False
    ours.noise_scale_momentum = 0.5
    ours.skip_nonfinite = False
    parent_variable = keras.Variable(np.ones(2, "float32"))
    parent = keras.optimizers.Adam(0.1)
    grad = keras.ops.convert_to_tensor([0.5, -2.0])
    ours.apply([grad], [variable])
    parent.apply([grad], [parent_variable])
    assert len(ours.variables) == len(parent.variables)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(variable),
        keras.ops.convert_to_numpy(parent_variable),
    )
