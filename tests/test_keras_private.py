"""Every private Keras API listed in `_keras_private` still behaves as we
rely on, so a Keras upgrade that changes one fails here, by name, not deep
in a window. Each test exercises the behaviour, not only the name."""

import importlib
import threading

import keras
import numpy as np
import pytest

import accum_optimizers
from accum_optimizers import _keras_private

BACKEND = keras.backend.backend()


def _built_adam(**kwargs):
    variables = [keras.Variable([1.0, 2.0]), keras.Variable([[3.0]])]
    optimizer = keras.optimizers.Adam(**kwargs)
    optimizer.build(variables)
    return optimizer, variables


def _grads(variables, value=0.5):
    return [keras.ops.full(v.shape, value) for v in variables]


def test_every_listed_name_is_covered_here():
    assert set(_keras_private.OPTIMIZER_ATTRIBUTES) == {
        "_iterations",
        "_trainable_variables",
        "_get_variable_index",
        "_check_variables_are_known",
        "_track_variable",
        "_overwrite_variable_with_gradient",
        "_get_current_learning_rate",
        "_apply_weight_decay",
        "_use_weight_decay",
    }


def test_every_listed_private_name_exists_in_the_installed_keras():
    # The registries name what the package touches; a Keras that renames
    # one fails here, not in a user's run.
    optimizer, _ = _built_adam()
    for name in _keras_private.OPTIMIZER_ATTRIBUTES:
        assert hasattr(optimizer, name), name
    module = _keras_private.loss_module()
    for name in _keras_private.LOSS_MODULE_FUNCTIONS:
        assert callable(getattr(module, name, None)), name
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    for name in _keras_private.TRAINER_ATTRIBUTES:
        assert hasattr(model, name), name
    if keras.backend.backend() == "tensorflow":
        for name in _keras_private.TENSORFLOW_OPTIMIZER_ATTRIBUTES:
            assert hasattr(optimizer, name), name
    if keras.backend.backend() == "torch":
        import torch

        for name in _keras_private.TORCH_FOREACH_FUNCTIONS:
            assert callable(getattr(torch, name, None)), name


def test_iterations_is_the_update_counter_variable():
    optimizer, variables = _built_adam()
    optimizer.apply(_grads(variables), variables)
    optimizer.apply(_grads(variables), variables)
    assert isinstance(optimizer._iterations, keras.Variable)
    assert int(optimizer._iterations.value) == 2
    assert int(optimizer.iterations) == 2


def test_trainable_variables_and_their_indices():
    optimizer, variables = _built_adam()
    assert list(optimizer._trainable_variables) == variables
    assert [optimizer._get_variable_index(v) for v in variables] == [0, 1]


def test_check_variables_are_known_refuses_a_stranger():
    optimizer, variables = _built_adam()
    optimizer._check_variables_are_known(variables)
    with pytest.raises(ValueError):
        optimizer._check_variables_are_known([keras.Variable([0.0])])


def test_track_variable_makes_it_an_optimizer_variable():
    optimizer, _ = _built_adam()
    extra = keras.Variable(0, dtype="int32", trainable=False, name="extra")
    optimizer._track_variable(extra)
    assert any(v is extra for v in optimizer.variables)


def test_overwrite_variable_with_gradient_reads_the_variable_flag():
    optimizer, variables = _built_adam()
    assert not optimizer._overwrite_variable_with_gradient(variables[0])
    scale = keras.Variable(1.0)
    scale.overwrite_with_gradient = True
    assert optimizer._overwrite_variable_with_gradient(scale)


def test_current_learning_rate_is_the_schedule_at_iterations():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)
    optimizer, variables = _built_adam(learning_rate=schedule)
    for _ in range(3):
        optimizer.apply(_grads(variables), variables)
    np.testing.assert_allclose(
        float(optimizer._get_current_learning_rate()), 0.125
    )


def test_decay_weight_is_keras_weight_decay_of_one_variable():
    # Keras' own decay on one optimizer's variables, ours on another's; the
    # second variable, excluded by name, is left alone by both.
    decayed = []
    for decay in ("keras", "ours"):
        variables = [keras.Variable([1.0, 2.0]), keras.Variable([[3.0]])]
        optimizer = keras.optimizers.Adam(learning_rate=0.5, weight_decay=0.1)
        optimizer.exclude_from_weight_decay(var_names=[variables[1].name])
        optimizer.build(variables)
        if decay == "keras":
            optimizer._apply_weight_decay(variables)
        else:
            for variable in variables:
                _keras_private.decay_weight(optimizer, variable)
        decayed.append([keras.ops.convert_to_numpy(v) for v in variables])
    for keras_value, our_value in zip(*decayed):
        np.testing.assert_array_equal(our_value, keras_value)
    np.testing.assert_allclose(decayed[1][0], [0.95, 1.9])
    np.testing.assert_array_equal(decayed[1][1], [[3.0]])


@pytest.mark.backends("tensorflow")
def test_tensorflow_strategy_and_all_reduce_outside_a_strategy():
    import tensorflow as tf

    optimizer, variables = _built_adam()
    assert optimizer._distribution_strategy is tf.distribute.get_strategy()
    pairs = list(zip(_grads(variables, 0.25), variables))
    reduced = optimizer._all_reduce_sum_gradients(pairs)
    for (grad, variable), (expected, same) in zip(reduced, pairs):
        assert variable is same
        np.testing.assert_allclose(np.array(grad), np.array(expected))


@pytest.mark.backends("tensorflow")
def test_tensorflow_xla_and_merge_call_are_detected():
    import tensorflow as tf

    assert _keras_private.in_xla_context() is False
    assert _keras_private.strategy_needs_merge_call() is False
    seen = {}

    def record(key):
        seen[key] = _keras_private.in_xla_context()
        return tf.constant(0.0)

    tf.function(lambda: record("graph"))()
    tf.function(lambda: record("xla"), jit_compile=True)()
    assert seen == {"graph": False, "xla": True}
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    inside = strategy.run(
        lambda: tf.constant(_keras_private.strategy_needs_merge_call())
    )
    assert bool(inside)


@pytest.mark.backends("tensorflow")
def test_xla_unfused_keeps_its_value_apart_from_its_consumers():
    import tensorflow as tf

    def sum_of_squares(x):
        return tf.reduce_sum(_keras_private.xla_unfused(tf.square(x)))

    compiled = tf.function(sum_of_squares, jit_compile=True)
    x = tf.constant([1.0, -2.0, 3.0])
    assert float(compiled(x)) == 14.0
    assert "opt-barrier" in compiled.experimental_get_compiler_ir(x)(
        stage="hlo"
    )


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


def test_variable_layout_is_none_without_a_distribution():
    assert _keras_private.variable_layout(keras.Variable([1.0])) is None
    assert _keras_private.variable_layout(None) is None


@pytest.mark.backends("jax")
def test_variable_layout_follows_the_distribution_on_jax():
    import jax

    devices = jax.devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with distribution.scope():
        variable = keras.Variable(np.ones((2, 2)), name="kernel")
    assert _keras_private.variable_layout(variable) is not None


@pytest.mark.backends("jax")
def test_is_jax_tracer_inside_jit_only():
    import jax

    seen = []
    jax.jit(lambda x: seen.append(_keras_private.is_jax_tracer(x)) or x)(1.0)
    assert seen == [True]
    assert not _keras_private.is_jax_tracer(jax.numpy.ones(()))


@pytest.mark.backends("torch")
def test_torch_foreach_functions_work_in_place():
    import torch

    targets = [torch.ones(2), torch.full((1,), 2.0)]
    ids = [id(t) for t in targets]
    _keras_private.torch_foreach_add_(
        targets, [torch.ones(2), torch.ones(1)], alpha=3
    )
    assert [t.tolist() for t in targets] == [[4.0, 4.0], [5.0]]
    _keras_private.torch_foreach_div_(targets, torch.tensor(2.0))
    assert [t.tolist() for t in targets] == [[2.0, 2.0], [2.5]]
    _keras_private.torch_foreach_zero_(targets)
    assert [t.tolist() for t in targets] == [[0.0, 0.0], [0.0]]
    _keras_private.torch_foreach_copy_(
        targets, [torch.full((2,), 7.0), torch.full((1,), 8.0)]
    )
    assert [t.tolist() for t in targets] == [[7.0, 7.0], [8.0]]
    assert [id(t) for t in targets] == ids


@pytest.mark.backends("torch")
def test_torch_host_value_reads_the_tensors_numpy_holds():
    import torch

    read = _keras_private.torch_host_value
    np.testing.assert_array_equal(read(torch.tensor([1.0, 2.0])), [1.0, 2.0])
    assert read(torch.ones(1, requires_grad=True)).tolist() == [1.0]
    assert read(torch.ones(2, dtype=torch.bfloat16)) is None
    assert read(np.ones(2)) is None


def test_is_multi_optimizer():
    adam = keras.optimizers.Adam()
    assert not _keras_private.is_multi_optimizer(adam)
    if hasattr(keras.optimizers, "MultiOptimizer"):
        multi = keras.optimizers.MultiOptimizer(adam)
        assert _keras_private.is_multi_optimizer(multi)


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
def test_multi_optimizer_groups_are_what_apply_hands_each_inner_one():
    sgd, adam = keras.optimizers.SGD(), keras.optimizers.Adam()
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(adam, {"b.*": sgd})
    )
    variables = [
        keras.Variable(np.zeros(2, "float32"), name=name)
        for name in ("a1", "b1", "a2")
    ]
    multi.build(variables)
    grads = _grads(variables)
    handed = []
    for inner in (sgd, adam):
        inner.apply = lambda g, v, inner=inner: handed.append((inner, g, v))
    multi.apply(grads, variables)
    groups = _keras_private.multi_optimizer_groups(multi, grads, variables)
    assert [(o, list(g), list(v)) for o, g, v in groups] == [
        (o, list(g), list(v)) for o, g, v in handed
    ]
    assert [o for o, *_ in groups] == [sgd, adam]
    assert [v.name for v in groups[1][2]] == ["a1", "a2"]


def test_batch_normalization_reduction_axes_and_moments():
    layer = keras.layers.BatchNormalization(axis=-1)
    inputs = np.arange(24, dtype="float32").reshape(2, 3, 4)
    layer.build(inputs.shape)
    assert list(layer._reduction_axes) == [0, 1]
    mean, variance = layer._moments(keras.ops.convert_to_tensor(inputs), None)
    np.testing.assert_allclose(np.array(mean), inputs.mean(axis=(0, 1)))
    np.testing.assert_allclose(
        np.array(variance), inputs.var(axis=(0, 1)), rtol=1e-6
    )
    mask = np.array([[1, 1, 0], [1, 0, 0]], "float32")
    mean, _ = layer._moments(
        keras.ops.convert_to_tensor(inputs), keras.ops.convert_to_tensor(mask)
    )
    kept = inputs[mask.astype(bool)]
    np.testing.assert_allclose(np.array(mean), kept.mean(axis=0), rtol=1e-6)


def test_batch_norm_renorm_reads_the_layer_flag():
    assert not _keras_private.batch_norm_renorm(
        keras.layers.BatchNormalization()
    )
    if (
        "renorm"
        not in keras.layers.BatchNormalization.__init__.__code__.co_varnames
    ):
        pytest.skip(f"Keras {keras.version()} has no batch renormalization")
    layer = keras.layers.BatchNormalization(renorm=True)
    assert _keras_private.batch_norm_renorm(layer)
    for name in _keras_private.BATCH_NORMALIZATION_ATTRIBUTES:
        assert callable(getattr(layer, name, None)) or name == "_reduction_axes"


def test_loss_module_functions_behave_as_weighting_reads_them():
    module = _keras_private.loss_module()
    assert (
        module.standardize_reduction("sum_over_batch_size")
        == "sum_over_batch_size"
    )
    with pytest.raises(ValueError):
        module.standardize_reduction("no such reduction")
    x1, x2 = module.squeeze_or_expand_to_same_rank(
        keras.ops.ones((3, 1)), keras.ops.ones((3,))
    )
    assert len(x1.shape) == len(x2.shape)
    mask = keras.ops.convert_to_tensor([True, False, True])
    weights = module.apply_mask(None, mask, "float32", "sum")
    np.testing.assert_allclose(np.array(weights), [1.0, 0.0, 1.0])


def test_compute_loss_has_training_arg_reads_the_signature():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert model._compute_loss_has_training_arg is True

    class OldStyle(keras.Sequential):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            return super().compute_loss(x, y, y_pred, sample_weight)

    old = OldStyle([keras.Input((2,)), keras.layers.Dense(1)])
    assert old._compute_loss_has_training_arg is False


def test_recorded_loss_reductions_see_keras_losses_of_this_thread_only():
    module = _keras_private.loss_module()
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    args = (keras.ops.ones((3, 2)), keras.ops.zeros((3, 2)), [1.0, 2.0, 0.5])
    elsewhere = []
    with _keras_private.recorded_loss_reductions() as records:
        # Another thread's loss, computed while this thread records.
        thread = threading.Thread(target=lambda: elsewhere.append(loss(*args)))
        thread.start()
        thread.join()
        inside = loss(*args)
    assert [r.reduction for r in records] == ["mean_with_sample_weight"]
    assert tuple(records[0].values.shape) == (3,)
    # The wrapper stays, installed once, and passes through outside.
    wrapper = module.reduce_weighted_values
    with _keras_private.recorded_loss_reductions():
        pass
    assert module.reduce_weighted_values is wrapper
    outside = loss(*args)
    assert len(records) == 1
    for value in (elsewhere[0], outside):
        assert float(keras.ops.convert_to_numpy(value)) == float(
            keras.ops.convert_to_numpy(inside)
        )


class _Recording(keras.optimizers.SGD):
    """SGD that records its `scale_loss` and `apply` calls, by thread."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events = []

    def scale_loss(self, loss):
        self.events.append(("scale_loss", threading.get_ident()))
        return super().scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        self.events.append(("apply", threading.get_ident()))
        return super().apply(grads, trainable_variables)


@pytest.mark.backends("jax", "torch")
def test_stateless_apply_runs_the_optimizers_apply():
    optimizer = _Recording(learning_rate=0.5)
    variables = [keras.Variable([1.0, 2.0])]
    optimizer.build(variables)
    new_values, _ = optimizer.stateless_apply(
        [v.value for v in optimizer.variables],
        _grads(variables, 1.0),
        [v.value for v in variables],
    )
    assert [event for event, _ in optimizer.events] == ["apply"]
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new_values[0]), [0.5, 1.5]
    )


def test_fit_calls_scale_loss_then_apply_on_one_thread():
    # `run_eagerly`: Python-side calls are seen once per step.
    optimizer = _Recording(learning_rate=0.1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
    x, y = np.ones((6, 2), "float32"), np.zeros((6, 1), "float32")
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    events = [event for event, _ in optimizer.events]
    assert events == ["scale_loss", "apply"] * 3
    pairs = zip(optimizer.events[::2], optimizer.events[1::2])
    assert all(first[1] == second[1] for first, second in pairs)


@pytest.mark.backends("jax")
def test_jax_train_step_loss_is_the_loss_keras_computed():
    # The JAX train step's `unscaled_loss`, read from the optimizer's
    # `apply`. Its value is checked against the model's own loss on the
    # big batch by test_window_features.py, in every compatibility leg.
    losses = []

    class Reading(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            losses.append(_keras_private.jax_train_step_loss())
            return super().apply(grads, trainable_variables)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=Reading(learning_rate=0.0), loss="mse")
    x = np.arange(8, dtype="float32").reshape(4, 2)
    y = np.ones((4, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert len(losses) == 1 and losses[0] is not None
    assert tuple(losses[0].shape) == ()  # a scalar tracer of the step
    assert _keras_private.jax_train_step_loss() is None  # outside a step


def test_sublayers_reach_a_layer_inside_a_custom_layer():
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.norm = keras.layers.BatchNormalization()

        def call(self, x):
            return self.norm(x)

    block = Block()
    model = keras.Sequential([keras.Input((3,)), block])
    found = _keras_private.sublayers(model)
    assert any(layer is block.norm for layer in found)
    assert any(layer is block for layer in found)


def test_fit_reads_its_logs_after_the_last_batch_and_before_validation():
    # `FlushAccumulation` flushes in `_get_metrics_result_or_logs`: fit must
    # call it after an epoch's last train batch, before validation and
    # before any `on_epoch_end`.
    events = []
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    original = model._get_metrics_result_or_logs

    def recording(logs):
        events.append("logs")
        return original(logs)

    model._get_metrics_result_or_logs = recording

    class Order(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            events.append("batch")

        def on_test_begin(self, logs=None):
            events.append("validation")

        def on_epoch_end(self, epoch, logs=None):
            events.append("epoch_end")

    x = np.ones((8, 2), "float32")
    model.fit(
        x,
        x[:, :1],
        batch_size=4,
        validation_data=(x, x[:, :1]),
        callbacks=[Order()],
        verbose=0,
    )
    first = events.index("logs")
    assert events[:first] == ["batch", "batch"]
    assert first < events.index("validation") < events.index("epoch_end")


def test_symbolic_build_builds_the_model_loss_metrics_and_optimizer():
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = np.ones((1, 3), "float32")
    _keras_private.symbolic_build(model, (x, x[:, :1], None))
    assert model.built and model.optimizer.built
    assert model.metrics_variables


@pytest.mark.backends("jax")
def test_jax_fit_puts_the_state_it_holds_back_when_a_step_fails():
    # `fit_to_memory` recovers from a step that failed right after `fit`
    # took the state off the variables: the state `fit` puts back is the
    # one `set_jax_state_to_variables` set.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 2), "float32")
    model.fit(x, x[:, :1], verbose=0)
    kernel = np.array(model.layers[0].kernel.numpy())
    seen = []

    class SetAndFail(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(
                _keras_private.jax_fit_takes_state_from_variables(model)
            )
            _keras_private.set_jax_state_to_variables(model)

    def failing_step(state, data):
        raise RuntimeError("the step failed")

    model.train_step = failing_step
    model.train_function = None
    with pytest.raises(RuntimeError, match="the step failed"):
        model.fit(x, x[:, :1], callbacks=[SetAndFail()], verbose=0)
    assert seen == [True]
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), kernel)


def test_global_seed_generator_state_is_put_back():
    keras.utils.set_random_seed(3)
    keras.random.normal((2,))  # makes the global generator
    saved = _keras_private.global_seed_generator_state()
    first = keras.ops.convert_to_numpy(keras.random.normal((2,)))
    _keras_private.restore_global_seed_generator(saved)
    again = keras.ops.convert_to_numpy(keras.random.normal((2,)))
    np.testing.assert_array_equal(again, first)
    # No generator (before the first draw; newer Keras' set_random_seed
    # drops it): restoring that removes the one a draw made since.
    _keras_private.restore_global_seed_generator((None, None))
    assert _keras_private.global_seed_generator_state() == (None, None)
    keras.random.normal((2,))
    assert _keras_private.global_seed_generator_state()[0] is not None
    _keras_private.restore_global_seed_generator((None, None))
    assert _keras_private.global_seed_generator_state() == (None, None)


def test_is_functional_where_clone_model_keeps_the_class():
    class Like(keras.Model):
        pass

    class Other(keras.Model):
        def __init__(self, width):
            inputs = keras.Input((2,))
            super().__init__(inputs, keras.layers.Dense(width)(inputs))

    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    functional = keras.Model(inputs, outputs)
    like = Like(inputs, outputs)
    assert _keras_private.is_functional(functional)
    assert _keras_private.is_functional(like)
    assert type(keras.models.clone_model(like)) is Like
    assert not _keras_private.is_functional(Other(1))
    assert not _keras_private.is_functional(keras.Sequential([inputs]))


def test_compiled_loss_weights_are_compiles_argument():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, [keras.layers.Dense(1)(inputs)] * 2)
    assert _keras_private.compiled_loss_weights(model) is None
    model.compile(loss=["mse", "mae"], loss_weights=[1.0, 0.5])
    assert _keras_private.compiled_loss_weights(model) == [1.0, 0.5]


def test_in_stateless_scope_is_true_only_inside_one():
    variable = keras.Variable(1.0)
    assert not _keras_private.in_stateless_scope()
    with keras.StatelessScope(state_mapping=[(variable, 2.0)]):
        assert _keras_private.in_stateless_scope()


def test_loss_scale_build_adds_its_step_counter_then_its_scale():
    # `_wrappers._saved_own_state` and `_saved_scale` read a loss scale's
    # saved state by position: the constructor's variables, then what
    # `build` adds, `step_counter` and then `dynamic_scale`, then the
    # inner optimizer's.
    variables = [keras.Variable([1.0, 2.0])]
    wrapper = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=8.0
    )
    before = len(wrapper._variables)
    wrapper.build(variables)
    step_counter, dynamic_scale = wrapper._variables[before:]
    assert step_counter is wrapper.step_counter
    assert dynamic_scale is wrapper.dynamic_scale
    assert float(keras.ops.convert_to_numpy(dynamic_scale)) == 8.0
    own = wrapper._variables
    assert [id(v) for v in wrapper.variables] == [
        id(v) for v in [*own, *wrapper.inner_optimizer.variables]
    ]
    store = {}
    wrapper.save_own_variables(store)
    saved = [np.asarray(store[str(i)]) for i in range(len(store))]
    assert len(saved) == len(own) + len(wrapper.inner_optimizer.variables)
    assert float(saved[len(own) - 1]) == 8.0


def test_wrappers_taking_an_optimizer_are_those_setting_its_scale_factor():
    # Keras' wrappers set an inner optimizer's `loss_scale_factor` as they
    # take it (`LossScaleOptimizer()`; `MultiOptimizer()` with a map, its
    # `build` with a function, its setter): where they meet an accumulating
    # optimizer, the package has that wrapper instance cooperate.
    met = []

    class Meeting(keras.optimizers.SGD):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "loss_scale_factor":
                met.append(_keras_private.wrappers_taking_an_optimizer())

    version = f"Keras {keras.__version__}"
    inner = Meeting()
    assert met[-1] == [], version  # its own constructor
    scale = keras.optimizers.LossScaleOptimizer(inner)
    assert met[-1] == [scale], version
    if not hasattr(keras.optimizers, "MultiOptimizer"):
        return
    mapped = Meeting()
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(mapped)
    )
    assert met[-1] == [multi], version
    multi.loss_scale_factor = 4.0  # not the value it holds: TF sets it
    assert met[-1] == [multi], version
    selected = Meeting()
    by_function = keras.optimizers.MultiOptimizer(lambda v: selected)
    outer = keras.optimizers.LossScaleOptimizer(by_function)
    count = len(met)
    outer.build([keras.Variable([1.0])])  # builds `by_function`
    assert met[count:] == [[by_function, outer]], version


@pytest.mark.backends("tensorflow")
@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
def test_tensorflow_tracking_initializes_the_optimizer_a_loss_scale_takes():
    # TensorFlow's `__setattr__` skips a `loss_scale_factor` set to the
    # value an optimizer holds: a `MultiOptimizer` meets the loss scale
    # that takes it where TensorFlow's tracking initializes it.
    met = []
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(keras.optimizers.SGD())
    )
    _keras_private.on_tensorflow_tracking(
        multi,
        lambda _: met.append(_keras_private.wrappers_taking_an_optimizer()),
    )
    scale = keras.optimizers.LossScaleOptimizer(multi)
    assert [scale] in met, f"Keras {keras.__version__}"
    assert scale.inner_optimizer is multi


@pytest.mark.backends("tensorflow")
def test_tensorflow_train_step_loss_is_the_loss_scale_loss_returned():
    # The TensorFlow train step's `self` and `loss` (what its optimizer's
    # `scale_loss` returned), read from the optimizer's `apply`.
    found = []

    class Reading(keras.optimizers.SGD):
        def scale_loss(self, loss):
            return loss * 4.0

        def apply(self, grads, trainable_variables=None):
            found.append(_keras_private.tensorflow_train_step_loss())
            return super().apply(grads, trainable_variables)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=Reading(learning_rate=0.0), loss="mse", run_eagerly=True
    )
    x = np.arange(8, dtype="float32").reshape(4, 2)
    y = np.ones((4, 1), "float32")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    version = f"Keras {keras.__version__}"
    assert len(found) == 1 and found[0] is not None, version
    assert found[0][0] is model, version
    loss = float(keras.ops.convert_to_numpy(found[0][1]))
    np.testing.assert_allclose(loss, 4.0 * history.history["loss"][0], 1e-6)
    assert _keras_private.tensorflow_train_step_loss() is None  # outside
