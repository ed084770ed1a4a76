"""Every private Keras API listed in `_keras_private` still behaves as we
rely on, so a Keras upgrade that changes one fails here, by name, not deep
in a window. Each test exercises the behaviour, not only the name."""

import ast
import importlib
import inspect
import pathlib
import re
import threading

import keras
import numpy as np
import pytest

import accum_optimizers
from accum_optimizers import _keras_private

BACKEND = keras.backend.backend()
VERSION = f"Keras {keras.__version__}"
# `BatchNormalization(renorm=True)` where the installed Keras has it (3.14).
RENORM = (
    {"renorm": True}
    if "renorm" in keras.layers.BatchNormalization.__init__.__code__.co_varnames
    else {}
)


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
        "_learning_rate",
        "_trainable_variables",
        "_variables",
        "_get_variable_index",
        "_check_variables_are_known",
        "_track_variable",
        "_overwrite_variable_with_gradient",
        "_apply_weight_decay",
    }
    assert set(_keras_private.OVERRIDDEN_OPTIMIZER_METHODS) == {
        "_apply_weight_decay",
        "_get_current_learning_rate",
    }


def _assert_has(obj, names):
    missing = [name for name in names if not hasattr(obj, name)]
    assert not missing, f"{VERSION}: {type(obj).__name__} lacks {missing}"


def test_every_listed_private_name_exists_in_the_installed_keras():
    # The registries name what the package touches; a Keras that renames
    # one fails here, naming the Keras, not in a user's run.
    optimizer, variables = _built_adam()
    _assert_has(optimizer, _keras_private.OPTIMIZER_ATTRIBUTES)
    module = _keras_private.loss_module()
    for name in _keras_private.LOSS_MODULE_FUNCTIONS:
        assert callable(getattr(module, name, None)), f"{VERSION}: {name}"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    names = _keras_private.TRAINER_ATTRIBUTES + _keras_private.MODEL_ATTRIBUTES
    _assert_has(model, names)
    # `_layout`: test_variable_layout_follows_the_distribution_on_jax.
    layer = keras.layers.BatchNormalization()
    layer.build((2, 3))
    names = _keras_private.BATCH_NORMALIZATION_ATTRIBUTES
    if not _keras_private.batch_norm_renorm(
        keras.layers.BatchNormalization(**RENORM)
    ):
        names = names[:2]  # the renorm methods arrived with it, in 3.14
    _assert_has(layer, names)
    if hasattr(keras.optimizers, "MultiOptimizer"):
        multi = keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(keras.optimizers.SGD())
        )
        multi.build(variables)
        names = _keras_private.MULTI_OPTIMIZER_ATTRIBUTES
        _assert_has(multi, names)
    if BACKEND == "tensorflow":
        names = _keras_private.TENSORFLOW_OPTIMIZER_ATTRIBUTES
        _assert_has(optimizer, names)
    if BACKEND == "jax":
        model.fit(np.ones((2, 2)), np.ones((2, 1)), verbose=0)
        names = _keras_private.JAX_TRAINER_ATTRIBUTES
        _assert_has(model, names)
    if BACKEND == "torch":
        import torch

        for name in _keras_private.TORCH_FOREACH_FUNCTIONS:
            assert callable(getattr(torch, name, None)), f"{VERSION}: {name}"


def _overridden():
    names = _keras_private.OVERRIDDEN_OPTIMIZER_METHODS
    if BACKEND == "tensorflow":
        names += _keras_private.OVERRIDDEN_TENSORFLOW_OPTIMIZER_METHODS
    return names


@pytest.mark.parametrize("name", ["SGD", "AdamW", "Muon"])
def test_overridden_private_methods_are_keras_own_with_our_parameters(name):
    parent = _keras_private.fused_class(getattr(keras.optimizers, name))
    ours = getattr(accum_optimizers, f"{name}Accumulate")
    for method in _overridden():
        keras_method = getattr(parent, method, None)
        assert keras_method is not None, f"{VERSION}: {name}.{method}"
        assert list(inspect.signature(keras_method).parameters) == list(
            inspect.signature(getattr(ours, method)).parameters
        ), f"{VERSION}: {name}.{method}"
    # Our classes override no other private method of Keras' (the
    # TensorFlow-only override is ours elsewhere, and Keras' has none).
    overriding = {
        attribute
        for cls in ours.__mro__
        if cls.__module__.startswith("accum_optimizers")
        for attribute in vars(cls)
        if attribute.startswith("_")
        and not attribute.startswith("__")
        and hasattr(parent, attribute)
    }
    assert overriding == set(_overridden()), VERSION


# What the package's code may reach of Keras (and TensorFlow, JAX, torch)
# outside `_keras_private`: private names Keras defines only as the
# overrides listed there, no `keras.src` (nor `tensorflow.python`,
# `jax._src`) import, no private attribute of those modules.
_KERAS_SOURCE = pathlib.Path(keras.__file__).parent / "src"
_PACKAGE = pathlib.Path(accum_optimizers.__file__).parent
_BACKEND_MODULES = {"tf", "tensorflow", "jax", "jnp", "torch"}
_PRIVATE_MODULES = ("keras.src", "tensorflow.python", "jax._src", "torch._")


def _keras_private_names():
    """The private names Keras' source defines: its `def _x` and its
    `self._x = ...`."""
    names = set()
    for path in _KERAS_SOURCE.rglob("*.py"):
        if not path.name.endswith("_test.py"):
            text = path.read_text(encoding="utf-8")
            names.update(re.findall(r"def (_[A-Za-z]\w*)", text))
            names.update(re.findall(r"self\.(_[A-Za-z]\w*)\s*=", text))
    return names


def _accesses(tree):
    """`(line, what)` of each private name `tree` reaches of Keras and the
    backends: attributes, `getattr`'s strings, imports."""
    keras_names = _KERAS_NAMES
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in _BACKEND_MODULES:
                yield node.lineno, f"{base.id}.{node.attr}"
            elif node.attr in keras_names and not _super_call(base):
                yield node.lineno, f"{ast.unparse(base)}.{node.attr}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in keras_names or node.value.startswith(
                _PRIVATE_MODULES
            ):
                yield node.lineno, repr(node.value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names]
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            for module in modules:
                if module.startswith(_PRIVATE_MODULES):
                    yield node.lineno, f"import {module}"


def _super_call(node):
    """`super()`: an override calling Keras' own."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "super"
    )


_KERAS_NAMES = _keras_private_names()


def test_keras_private_names_are_reached_only_through_keras_private():
    found = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if "_keras_private" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [
            f"{path.relative_to(_PACKAGE)}:{line}: {what}"
            for line, what in _accesses(tree)
        ]
    assert found == [], found


def test_keras_private_lists_every_keras_name_it_reaches():
    # So `test_every_listed_private_name_exists_in_the_installed_keras`
    # checks each against the installed Keras.
    listed = set(
        _keras_private.OPTIMIZER_ATTRIBUTES
        + _keras_private.TENSORFLOW_OPTIMIZER_ATTRIBUTES
        + _keras_private.OVERRIDDEN_OPTIMIZER_METHODS
        + _keras_private.OVERRIDDEN_TENSORFLOW_OPTIMIZER_METHODS
        + _keras_private.MULTI_OPTIMIZER_ATTRIBUTES
        + _keras_private.VARIABLE_ATTRIBUTES
        + _keras_private.MODEL_ATTRIBUTES
        + _keras_private.TRAINER_ATTRIBUTES
        + _keras_private.JAX_TRAINER_ATTRIBUTES
        + _keras_private.BATCH_NORMALIZATION_ATTRIBUTES
    )
    reached = set()
    for path in (_PACKAGE / "_keras_private").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant):
                name = node.value
            else:
                continue
            if isinstance(name, str) and name in _KERAS_NAMES:
                reached.add(name)
    assert reached <= listed, sorted(reached - listed)


def test_iterations_is_the_update_counter_variable():
    optimizer, variables = _built_adam()
    optimizer.apply(_grads(variables), variables)
    optimizer.apply(_grads(variables), variables)
    counter = _keras_private.iterations_variable(optimizer)
    assert isinstance(counter, keras.Variable), VERSION
    assert int(counter.value) == 2, VERSION
    assert int(optimizer.iterations) == 2, VERSION


def test_learning_rate_as_given_is_the_schedule_not_its_value():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)
    optimizer, _ = _built_adam(learning_rate=schedule)
    assert _keras_private.learning_rate_as_given(optimizer) is schedule, VERSION
    plain, _ = _built_adam(learning_rate=0.25)
    given = _keras_private.learning_rate_as_given(plain)
    assert float(keras.ops.convert_to_numpy(given)) == 0.25, VERSION


def test_trainable_variables_and_their_indices():
    optimizer, variables = _built_adam()
    built = _keras_private.trainable_variables(optimizer)
    assert list(built) == variables, VERSION
    indices = [_keras_private.variable_index(optimizer, v) for v in variables]
    assert indices == [0, 1], VERSION


def test_check_variables_are_known_refuses_a_stranger():
    optimizer, variables = _built_adam()
    _keras_private.check_variables_are_known(optimizer, variables)
    with pytest.raises(ValueError):
        _keras_private.check_variables_are_known(
            optimizer, [keras.Variable([0.0])]
        )


def test_track_variable_makes_it_an_optimizer_variable():
    optimizer, _ = _built_adam()
    extra = keras.Variable(0, dtype="int32", trainable=False, name="extra")
    _keras_private.track_variable(optimizer, extra)
    assert any(v is extra for v in optimizer.variables), VERSION


def test_overwrite_variable_with_gradient_reads_the_variable_flag():
    optimizer, variables = _built_adam()
    overwrites = _keras_private.overwrites_with_gradient
    assert not overwrites(optimizer, variables[0]), VERSION
    scale = keras.Variable(1.0)
    scale.overwrite_with_gradient = True
    assert overwrites(optimizer, scale), VERSION


def test_current_learning_rate_is_the_schedule_at_iterations():
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5)
    optimizer, variables = _built_adam(learning_rate=schedule)
    for _ in range(3):
        optimizer.apply(_grads(variables), variables)
    np.testing.assert_allclose(
        float(optimizer._get_current_learning_rate()), 0.125, err_msg=VERSION
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
    strategy = _keras_private.distribution_strategy(optimizer)
    assert strategy is tf.distribute.get_strategy(), VERSION
    pairs = list(zip(_grads(variables, 0.25), variables))
    reduced = optimizer._all_reduce_sum_gradients(pairs)  # overridden
    for (grad, variable), (expected, same) in zip(reduced, pairs):
        assert variable is same, VERSION
        np.testing.assert_allclose(np.array(grad), np.array(expected))


@pytest.mark.backends("tensorflow")
def test_tensorflow_xla_and_merge_call_are_detected():
    import tensorflow as tf

    assert _keras_private.in_xla_context() is False, VERSION
    assert _keras_private.strategy_needs_merge_call() is False, VERSION
    seen = {}

    def record(key):
        seen[key] = _keras_private.in_xla_context()
        return tf.constant(0.0)

    tf.function(lambda: record("graph"))()
    tf.function(lambda: record("xla"), jit_compile=True)()
    assert seen == {"graph": False, "xla": True}, VERSION
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    inside = strategy.run(
        lambda: tf.constant(_keras_private.strategy_needs_merge_call())
    )
    assert bool(inside), VERSION


@pytest.mark.backends("tensorflow")
def test_xla_unfused_keeps_its_value_apart_from_its_consumers():
    import tensorflow as tf

    def sum_of_squares(x):
        return tf.reduce_sum(_keras_private.xla_unfused(tf.square(x)))

    compiled = tf.function(sum_of_squares, jit_compile=True)
    x = tf.constant([1.0, -2.0, 3.0])
    assert float(compiled(x)) == 14.0, VERSION
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
        assert expected is not parent, VERSION
    else:
        expected = parent
    assert type(parent()) is expected, VERSION
    assert _keras_private.fused_class(parent) is expected, VERSION
    # The accumulating class is itself, and builds on what Keras runs.
    ours = getattr(accum_optimizers, f"{name}Accumulate")
    assert type(ours()) is ours, VERSION
    assert expected in ours.__mro__ and parent in ours.__mro__, VERSION


def test_variable_layout_is_none_without_a_distribution():
    assert _keras_private.variable_layout(keras.Variable([1.0])) is None
    assert _keras_private.variable_layout(None) is None, VERSION


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
    assert _keras_private.variable_layout(variable) is not None, VERSION


@pytest.mark.backends("jax")
def test_is_jax_tracer_inside_jit_only():
    import jax

    seen = []
    jax.jit(lambda x: seen.append(_keras_private.is_jax_tracer(x)) or x)(1.0)
    assert seen == [True], VERSION
    assert not _keras_private.is_jax_tracer(jax.numpy.ones(())), VERSION


@pytest.mark.backends("torch")
def test_torch_foreach_functions_work_in_place():
    import torch

    targets = [torch.ones(2), torch.full((1,), 2.0)]
    ids = [id(t) for t in targets]
    _keras_private.torch_foreach_add_(
        targets, [torch.ones(2), torch.ones(1)], alpha=3
    )
    assert [t.tolist() for t in targets] == [[4.0, 4.0], [5.0]], VERSION
    _keras_private.torch_foreach_div_(targets, torch.tensor(2.0))
    assert [t.tolist() for t in targets] == [[2.0, 2.0], [2.5]], VERSION
    _keras_private.torch_foreach_zero_(targets)
    assert [t.tolist() for t in targets] == [[0.0, 0.0], [0.0]], VERSION
    _keras_private.torch_foreach_copy_(
        targets, [torch.full((2,), 7.0), torch.full((1,), 8.0)]
    )
    assert [t.tolist() for t in targets] == [[7.0, 7.0], [8.0]], VERSION
    assert [id(t) for t in targets] == ids, VERSION


@pytest.mark.backends("torch")
def test_torch_host_value_reads_the_tensors_numpy_holds():
    import torch

    read = _keras_private.torch_host_value
    np.testing.assert_array_equal(read(torch.tensor([1.0, 2.0])), [1.0, 2.0])
    assert read(torch.ones(1, requires_grad=True)).tolist() == [1.0], VERSION
    assert read(torch.ones(2, dtype=torch.bfloat16)) is None, VERSION
    assert read(np.ones(2)) is None, VERSION


def test_is_multi_optimizer():
    adam = keras.optimizers.Adam()
    assert not _keras_private.is_multi_optimizer(adam), VERSION
    if hasattr(keras.optimizers, "MultiOptimizer"):
        multi = keras.optimizers.MultiOptimizer(adam)
        assert _keras_private.is_multi_optimizer(multi), VERSION


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
    assert [o for o, *_ in groups] == [sgd, adam], VERSION
    assert [v.name for v in groups[1][2]] == ["a1", "a2"], VERSION


def test_batch_normalization_reduction_axes_and_moments():
    layer = keras.layers.BatchNormalization(axis=-1)
    inputs = np.arange(24, dtype="float32").reshape(2, 3, 4)
    layer.build(inputs.shape)
    axes = _keras_private.batch_norm_reduction_axes(layer)
    assert list(axes) == [0, 1], VERSION
    moments = _keras_private.batch_norm_moments
    mean, variance = moments(layer, keras.ops.convert_to_tensor(inputs), None)
    np.testing.assert_allclose(np.array(mean), inputs.mean(axis=(0, 1)))
    np.testing.assert_allclose(
        np.array(variance), inputs.var(axis=(0, 1)), rtol=1e-6
    )
    mask = np.array([[1, 1, 0], [1, 0, 0]], "float32")
    mean, _ = moments(
        layer,
        keras.ops.convert_to_tensor(inputs),
        keras.ops.convert_to_tensor(mask),
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
    assert _keras_private.batch_norm_renorm(layer), VERSION
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
    assert len(x1.shape) == len(x2.shape), VERSION
    mask = keras.ops.convert_to_tensor([True, False, True])
    weights = module.apply_mask(None, mask, "float32", "sum")
    np.testing.assert_allclose(np.array(weights), [1.0, 0.0, 1.0])


def test_compute_loss_has_training_arg_reads_the_signature():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert _keras_private.compute_loss_takes_training(model) is True, VERSION

    class OldStyle(keras.Sequential):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            return super().compute_loss(x, y, y_pred, sample_weight)

    old = OldStyle([keras.Input((2,)), keras.layers.Dense(1)])
    assert _keras_private.compute_loss_takes_training(old) is False, VERSION
    _keras_private.set_compute_loss_takes_training(old)
    assert _keras_private.compute_loss_takes_training(old) is True, VERSION


def test_recorded_loss_reductions_see_keras_losses_of_this_thread_only():
    module = _keras_private.loss_module()
    keras_function = module.reduce_weighted_values
    assert keras_function.__module__ == module.__name__, VERSION
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
    assert tuple(records[0].values.shape) == (3,), VERSION
    # Keras' function is back once no recording runs.
    assert module.reduce_weighted_values is keras_function, VERSION
    outside = loss(*args)
    assert len(records) == 1, VERSION
    for value in (elsewhere[0], outside):
        assert float(keras.ops.convert_to_numpy(value)) == float(
            keras.ops.convert_to_numpy(inside)
        )


def test_recordings_in_two_threads_keep_the_wrapper_until_both_end():
    module = _keras_private.loss_module()
    keras_function = module.reduce_weighted_values
    loss = keras.losses.MeanSquaredError()
    args = (keras.ops.ones((2, 3)), keras.ops.zeros((2, 3)))
    started, ended = threading.Event(), threading.Event()
    other = []

    def record_in_another_thread():
        with _keras_private.recorded_loss_reductions() as records:
            started.set()
            ended.wait(60)
            loss(*args)
        other.append(records)

    thread = threading.Thread(target=record_in_another_thread)
    thread.start()
    started.wait(60)
    with _keras_private.recorded_loss_reductions() as records:
        loss(*args)
    # This thread's recording ended; the other one's still runs.
    assert module.reduce_weighted_values is not keras_function, VERSION
    ended.set()
    thread.join()
    assert module.reduce_weighted_values is keras_function, VERSION
    assert [len(records), len(other[0])] == [1, 1], VERSION


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
    assert [event for event, _ in optimizer.events] == ["apply"], VERSION
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
    assert events == ["scale_loss", "apply"] * 3, VERSION
    pairs = zip(optimizer.events[::2], optimizer.events[1::2])
    assert all(first[1] == second[1] for first, second in pairs), VERSION


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
    assert len(losses) == 1 and losses[0] is not None, VERSION
    assert tuple(losses[0].shape) == (), VERSION  # a scalar tracer of the step
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
    assert any(layer is block.norm for layer in found), VERSION
    assert any(layer is block for layer in found), VERSION


def test_fit_reads_its_logs_after_the_last_batch_and_before_validation():
    # `FlushAccumulation` flushes in `call_before_epoch_logs`: fit must
    # call it after an epoch's last train batch, before validation and
    # before any `on_epoch_end`.
    events = []
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    _keras_private.call_before_epoch_logs(model, lambda: events.append("logs"))

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
    assert events[:first] == ["batch", "batch"], VERSION
    assert first < events.index("validation") < events.index("epoch_end"), (
        VERSION
    )
    _keras_private.stop_calling_before_epoch_logs(model)
    del events[:]
    model.fit(x, x[:, :1], batch_size=4, verbose=0)
    assert events == [], VERSION


def test_renorm_methods_give_keras_renormalized_statistics():
    layer = keras.layers.BatchNormalization(**RENORM)
    if not _keras_private.batch_norm_renorm(layer):
        pytest.skip(f"{VERSION} has no batch renormalization")
    inputs = keras.ops.convert_to_tensor(
        np.arange(8, dtype="float32").reshape(4, 2)
    )
    layer.build(inputs.shape)
    mean, variance = _keras_private.batch_norm_moments(layer, inputs, None)
    r, d, mean, variance = (
        _keras_private.batch_norm_renorm_correction_and_moments(
            layer, mean, variance
        )
    )
    gamma, beta = _keras_private.batch_norm_compose_transforms(
        layer, r, d, layer.gamma, layer.beta, "float32"
    )
    assert tuple(gamma.shape) == tuple(beta.shape) == (2,), VERSION
    _keras_private.batch_norm_update_renorm_statistics(layer, mean, variance)
    moved = keras.ops.convert_to_numpy(layer.moving_mean)
    np.testing.assert_allclose(
        moved, 0.01 * np.array([3.0, 4.0]), rtol=1e-5, err_msg=VERSION
    )


def test_public_name_of_keras_optimizers_and_others():
    assert (
        _keras_private.public_name(keras.optimizers.Adam)
        == "keras.optimizers.Adam"
    ), VERSION
    assert _keras_private.public_name(_Recording) == f"{__name__}._Recording"


def test_symbolic_build_builds_the_model_loss_metrics_and_optimizer():
    model = keras.Sequential([keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = np.ones((1, 3), "float32")
    _keras_private.symbolic_build(model, (x, x[:, :1], None))
    assert model.built and model.optimizer.built, VERSION
    assert model.metrics_variables, VERSION


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
    assert seen == [True], VERSION
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
    assert _keras_private.global_seed_generator_state() == (None, None), VERSION
    keras.random.normal((2,))
    assert _keras_private.global_seed_generator_state()[0] is not None, VERSION
    _keras_private.restore_global_seed_generator((None, None))
    assert _keras_private.global_seed_generator_state() == (None, None), VERSION


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
    assert _keras_private.is_functional(functional), VERSION
    assert _keras_private.is_functional(like), VERSION
    assert type(keras.models.clone_model(like)) is Like, VERSION
    assert not _keras_private.is_functional(Other(1)), VERSION
    assert not _keras_private.is_functional(keras.Sequential([inputs])), VERSION


def test_compiled_loss_weights_are_compiles_argument():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, [keras.layers.Dense(1)(inputs)] * 2)
    assert _keras_private.compiled_loss_weights(model) is None, VERSION
    model.compile(loss=["mse", "mae"], loss_weights=[1.0, 0.5])
    assert _keras_private.compiled_loss_weights(model) == [1.0, 0.5], VERSION


def test_in_stateless_scope_is_true_only_inside_one():
    variable = keras.Variable(1.0)
    assert not _keras_private.in_stateless_scope(), VERSION
    with keras.StatelessScope(state_mapping=[(variable, 2.0)]):
        assert _keras_private.in_stateless_scope(), VERSION


def test_loss_scale_build_adds_its_step_counter_then_its_scale():
    # `_wrappers._saved_own_state` and `_saved_scale` read a loss scale's
    # saved state by position: the constructor's variables, then what
    # `build` adds, `step_counter` and then `dynamic_scale`, then the
    # inner optimizer's.
    variables = [keras.Variable([1.0, 2.0])]
    wrapper = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=8.0
    )
    before = len(_keras_private.own_variables(wrapper))
    wrapper.build(variables)
    step_counter, dynamic_scale = _keras_private.own_variables(wrapper)[before:]
    assert step_counter is wrapper.step_counter, VERSION
    assert dynamic_scale is wrapper.dynamic_scale, VERSION
    assert float(keras.ops.convert_to_numpy(dynamic_scale)) == 8.0, VERSION
    own = _keras_private.own_variables(wrapper)
    assert [id(v) for v in wrapper.variables] == [
        id(v) for v in [*own, *wrapper.inner_optimizer.variables]
    ]
    store = {}
    wrapper.save_own_variables(store)
    saved = [np.asarray(store[str(i)]) for i in range(len(store))]
    assert len(saved) == len(own) + len(wrapper.inner_optimizer.variables)
    assert float(saved[len(own) - 1]) == 8.0, VERSION


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
    assert scale.inner_optimizer is multi, VERSION


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
