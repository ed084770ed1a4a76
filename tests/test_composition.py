"""A user's own optimizer through `accumulating`, `MultiOptimizer` of
accumulating optimizers, and `LossScaleOptimizer` around one: each equals
its non-accumulating counterpart on the big batch in `model.fit`."""

import warnings

import keras
import pytest
from helpers import assert_same_weights
from helpers import regression_data
from helpers import small_model
from keras import ops

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import accumulating
from accum_optimizers.schedules import AccumSchedule
from accum_optimizers.schedules import by_noise_scale

K, B = 4, 2


@keras.saving.register_keras_serializable(package="tests")
class DampedMomentum(keras.optimizers.Optimizer):
    """A user's optimizer: momentum, with steps damped by their size."""

    def __init__(self, learning_rate=0.05, momentum=0.5, name=None, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.momentum = momentum

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._velocities = self.add_optimizer_variables(variables, "velocity")

    def update_step(self, gradient, variable, learning_rate):
        velocity = self._velocities[self._get_variable_index(variable)]
        self.assign(velocity, self.momentum * velocity + gradient)
        step = ops.cast(learning_rate, variable.dtype) * velocity
        self.assign_sub(variable, step / (1.0 + ops.abs(velocity)))

    def get_config(self):
        config = super().get_config()
        config["momentum"] = self.momentum
        return config


DampedMomentumAccumulate = accumulating(DampedMomentum)


def _fit(optimizer, batch_size, x, y, model=None, epochs=1):
    model = model or small_model(7)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    return model


def test_the_factory_names_and_caches_the_class():
    assert DampedMomentumAccumulate.__name__ == "DampedMomentumAccumulate"
    assert accumulating(DampedMomentum) is DampedMomentumAccumulate
    assert issubclass(DampedMomentumAccumulate, DampedMomentum)
    optimizer = DampedMomentumAccumulate(0.1, 0.9, accum_iters=3)
    assert (optimizer.momentum, optimizer.accum_iters) == (0.9, 3)


@pytest.mark.parametrize(
    "bad", [keras.optimizers.LossScaleOptimizer, keras.layers.Dense, "Adam"]
)
def test_the_factory_refuses_what_is_not_an_optimizer_class(bad):
    with pytest.raises(TypeError, match="optimizer_class"):
        accumulating(bad)


def test_a_users_optimizer_equals_itself_on_the_big_batch():
    x, y = regression_data(7, 6 * K * B)
    parent = _fit(DampedMomentum(), K * B, x, y)
    ours = _fit(DampedMomentumAccumulate(accum_iters=K), B, x, y)
    assert_same_weights(ours, parent)
    assert int(ours.optimizer.iterations) == 6


def test_a_users_optimizer_saved_mid_window_resumes_with_custom_objects(
    tmp_path,
):
    x, y = regression_data(8, 2 * K * B)
    uninterrupted = _fit(DampedMomentumAccumulate(accum_iters=K), B, x, y)
    interrupted = _fit(
        DampedMomentumAccumulate(accum_iters=K), B, x[: 5 * B], y[: 5 * B]
    )
    path = tmp_path / "custom.keras"
    interrupted.save(path)
    restored = keras.saving.load_model(
        path,
        custom_objects={
            "DampedMomentumAccumulate": DampedMomentumAccumulate,
            "DampedMomentum": DampedMomentum,
        },
    )
    assert type(restored.optimizer) is DampedMomentumAccumulate
    assert int(restored.optimizer.micro_steps) == 1
    restored.fit(x[5 * B :], y[5 * B :], batch_size=B, shuffle=False, verbose=0)
    assert_same_weights(restored, uninterrupted, rtol=1e-6, atol=1e-7)


class _Pairs(AccumSchedule):
    def __call__(self, update):
        return 2


def _multi(sgd, adam):
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(sgd, {"sequential/dense_1/.*": adam})
    )


def test_multi_optimizer_of_accumulating_optimizers_equals_big_batch():
    x, y = regression_data(9, 5 * K * B)
    parent = _fit(
        _multi(
            keras.optimizers.SGD(0.1, momentum=0.9), keras.optimizers.Adam(0.01)
        ),
        K * B,
        x,
        y,
    )
    keras.backend.clear_session()
    ours = _fit(
        _multi(
            SGDAccumulate(0.1, momentum=0.9, accum_iters=K),
            AdamAccumulate(0.01, accum_iters=K),
        ),
        B,
        x,
        y,
    )
    assert_same_weights(ours, parent)
    for inner in ours.optimizer.optimizers:
        assert int(inner.iterations) == 5


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
def test_a_multi_optimizer_warns_of_windows_sized_by_the_noise_scale():
    def measuring(cls, learning_rate, accum_iters):
        return cls(
            learning_rate, accum_iters=accum_iters, measure_noise_scale=True
        )

    x, y = regression_data(9, 2 * K * B)
    sized = by_noise_scale(micro_batch_size=B, floor=2, ceiling=K)
    keras.backend.clear_session()  # the layer names `_multi` maps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            _multi(
                measuring(SGDAccumulate, 0.1, K),
                measuring(AdamAccumulate, 0.01, K),
            ),
            B,
            x,
            y,
        )
    assert not [w for w in caught if "by_noise_scale" in str(w.message)]
    keras.backend.clear_session()
    with pytest.warns(UserWarning, match="by_noise_scale") as warned:
        _fit(
            _multi(
                measuring(SGDAccumulate, 0.1, K),
                measuring(AdamAccumulate, 0.01, sized),
            ),
            B,
            x,
            y,
            epochs=2,
        )
    apart = [w for w in warned if "by_noise_scale" in str(w.message)]
    assert len(apart) == 1  # once per MultiOptimizer


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
@pytest.mark.parametrize(
    "second, named",
    [
        (lambda: AdamAccumulate(0.01, accum_iters=K), None),
        # Keras' own accumulation over the same window
        (lambda: keras.optimizers.Adam(gradient_accumulation_steps=K), None),
        (lambda: AdamAccumulate(0.01, accum_iters=2), "accum_iters=2"),
        (lambda: keras.optimizers.Adam(0.01), "(Adam): every micro-batch"),
        (
            lambda: AdamAccumulate(0.01, accum_iters={0: K, 3: 2 * K}),
            "accum_iters={0: 4, 3: 8}",
        ),
        # A user's schedule without a config: named by its class.
        (
            lambda: AdamAccumulate(0.01, accum_iters=_Pairs()),
            "accum_iters=_Pairs(...)",
        ),
    ],
    ids=[
        "same",
        "keras-same",
        "other-k",
        "not-accumulating",
        "other-dict",
        "schedule-without-config",
    ],
)
def test_a_multi_optimizer_warns_once_of_optimizers_updating_apart(
    second, named
):
    # The model's variables updated at different micro-batches are no big
    # batch's: a `MultiOptimizer` says so, naming each optimizer's window.
    variables = [keras.Variable(ops.ones((2,))), keras.Variable(ops.ones(()))]
    first, second_optimizer = SGDAccumulate(0.1, accum_iters=K), second()
    multi = keras.optimizers.MultiOptimizer(
        lambda v: first if len(v.shape) else second_optimizer
    )
    caught = _warnings_of_three_calls(multi, variables)
    apart = [message for message in caught if "update at" in message]
    if named is None:
        assert not apart, apart
        return
    assert len(apart) == 1, apart  # once per MultiOptimizer
    assert f"'{first.name}' (SGDAccumulate): accum_iters=4" in apart[0]
    assert f"'{second_optimizer.name}' " in apart[0] and named in apart[0]


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
def test_a_lone_window_sized_by_the_noise_scale_is_named_beside_a_plain_one():
    # One accumulating optimizer has no other to close apart from by its
    # noise scale: the warning names its window and the plain one's.
    variables = [keras.Variable(ops.ones((2,))), keras.Variable(ops.ones(()))]
    sized = AdamAccumulate(
        accum_iters=by_noise_scale(micro_batch_size=B, floor=2, ceiling=K),
        measure_noise_scale=True,
    )
    plain = keras.optimizers.SGD(0.1)
    multi = keras.optimizers.MultiOptimizer(
        lambda v: sized if len(v.shape) else plain
    )
    caught = _warnings_of_three_calls(multi, variables)
    messages = [message for message in caught if "MultiOptimizer" in message]
    assert len(messages) == 1, messages
    assert "accum_iters=NoiseScaleAccumIters(...)" in messages[0]
    assert f"'{plain.name}' (SGD): every micro-batch" in messages[0]


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
def test_a_keras_file_of_a_multi_optimizer_loads_as_keras_own_does(tmp_path):
    # The oracle is Keras' own `MultiOptimizer`: where it loads no state
    # back (it warns), ours must warn too, not make the file unloadable;
    # where it does, ours must restore the pending window.
    x, y = regression_data(9, 3 * B)  # 3 micro-batches: one pending
    skipped = {}
    for name, sgd, adam in (
        ("keras", keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.01)),
        (
            "ours",
            SGDAccumulate(0.1, accum_iters=2),
            AdamAccumulate(0.01, accum_iters=2),
        ),
    ):
        keras.backend.clear_session()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the pending window
            model = _fit(_multi(sgd, adam), B, x, y)
        path = str(tmp_path / f"{name}.keras")
        model.save(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = keras.models.load_model(path)
        skipped[name] = any(
            "Skipping variable loading" in str(w.message) for w in caught
        )
        assert_same_weights(loaded, model, rtol=0, atol=0)
        if name == "ours" and not skipped["keras"]:
            for inner in loaded.optimizer.optimizers:
                assert int(inner.micro_steps) == 1
    assert skipped["ours"] == skipped["keras"], skipped


def test_loss_scale_optimizer_around_an_accumulating_one_equals_big_batch():
    x, y = regression_data(10, 5 * K * B)
    parent = _fit(keras.optimizers.Adam(0.01), K * B, x, y)
    ours = _fit(
        keras.optimizers.LossScaleOptimizer(
            AdamAccumulate(0.01, accum_iters=K), initial_scale=2.0**10
        ),
        B,
        x,
        y,
    )
    assert_same_weights(ours, parent)
    assert int(ours.optimizer.inner_optimizer.iterations) == 5


def test_the_factory_refuses_a_second_class_under_a_registered_name():
    class DampedMomentum(keras.optimizers.SGD):  # another class, same name
        pass

    with pytest.raises(ValueError, match="DampedMomentumAccumulate"):
        accumulating(DampedMomentum)


def _warnings_of_three_calls(multi, variables):
    """The messages of the warnings three `apply` calls of `multi` give,
    a gradient of ones for each of `variables` (a vector and a scalar)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            multi.apply([ops.ones((2,)), ops.ones(())], variables)
    return [str(w.message) for w in caught]
