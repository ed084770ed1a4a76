"""The three runs `check_exactness` compares, each on its own clone of the
model: the accumulating optimizer on micro-batches of `b`, its parent on
the big batches of `k * b`, and the parent on the same big batches with
each one's samples reordered (the round-off floor)."""

import contextlib
import random

import keras
import numpy as np

from accum_optimizers import _args
from accum_optimizers import _keras_private
from accum_optimizers._backend import random_state
from accum_optimizers._backend import set_random_state
from accum_optimizers.layers import AccumBatchNormalization
from accum_optimizers.weighting import weigh_micro_batches
from accum_optimizers.weighting import weighs_micro_batches


def is_random_layer(layer):
    """Whether `layer` draws random numbers: Keras' random layers
    (`Dropout`, `GaussianNoise`, random augmentation, ...) and layers of
    your own keep a `keras.random.SeedGenerator` as an attribute."""
    return any(
        isinstance(value, keras.random.SeedGenerator)
        for value in vars(layer).values()
    )


class _InInferenceMode(keras.layers.Layer):
    """Calls a random layer with `training=False`, where it draws nothing,
    so that runs that batch differently stay comparable."""

    def __init__(self, layer):
        super().__init__(name=layer.name, dtype=layer.dtype_policy)
        self.layer = layer
        self.supports_masking = layer.supports_masking

    def call(self, inputs, training=None):
        return self.layer(inputs, training=False)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)


def clone_model(model, batch_norm_accum_iters, random_layers_off):
    """A copy of `model` with its weights, its layers made anew.

    Args:
        model: the user's model (left untouched).
        batch_norm_accum_iters: the `accum_iters` its
            `AccumBatchNormalization` layers get: `None` keeps theirs (the
            accumulating run), `1` makes them `BatchNormalization` (the
            big-batch runs).
        random_layers_off: Boolean. Call random layers with
            `training=False`.

    Returns:
        `(clone, swapped)`: `swapped` is `False` for a model class of your
        own, which Keras clones from its config, whole: its layers keep
        their settings.
    """

    def clone_layer(layer):
        config = layer.get_config()
        if batch_norm_accum_iters is not None and isinstance(
            layer, AccumBatchNormalization
        ):
            config["accum_iters"] = batch_norm_accum_iters
        new = layer.__class__.from_config(config)
        if random_layers_off and is_random_layer(layer):
            return _InInferenceMode(new)
        return new

    with _as_uncompiled(model):
        if clones_layer_by_layer(model):
            clone = keras.models.clone_model(
                model, clone_function=clone_layer, recursive=True
            )
            swapped = True
        else:
            clone = keras.models.clone_model(model)
            swapped = False
    clone.set_weights(model.get_weights())
    return clone, swapped


@contextlib.contextmanager
def _as_uncompiled(model):
    """`clone_model` compiles a clone of a compiled model from its
    serialized compile config, which fails for a loss that is a lambda or
    an unregistered function; the clones are compiled with the loss object
    itself instead (`compile_like`)."""
    compiled = model.compiled
    model.compiled = False
    try:
        yield
    finally:
        model.compiled = compiled


def clones_layer_by_layer(model):
    """Whether `clone_model` takes a `clone_function` for `model`: a
    Sequential or Functional model (a subclass included, whose constructor
    takes the Functional one's arguments)."""
    # `clone_model` rebuilds a subclass of `Sequential` as a `Sequential`.
    return type(model) is keras.Sequential or _keras_private.is_functional(
        model
    )


def fresh_optimizers(optimizer):
    """`(accumulating, parent)`: new, unbuilt optimizers made from
    `optimizer`'s configuration, each wrapped in a `LossScaleOptimizer`
    like `optimizer`'s if it has one."""
    inner = optimizer
    scale = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = optimizer.inner_optimizer
        config = optimizer.get_config()
        scale = {
            "initial_scale": config["initial_scale"],
            "dynamic_growth_steps": config["dynamic_growth_steps"],
        }
    config = inner.get_config()
    accumulating = type(inner).from_config(config)
    parent_config = {
        key: value for key, value in config.items() if key not in _args.NAMES
    }
    if config.get("decay") is not None:
        # The Keras 2 time decay the accumulating class implements, keyed
        # on applied updates, as the parent's schedules are.
        parent_config["learning_rate"] = (
            keras.optimizers.schedules.InverseTimeDecay(
                inner.get_config()["learning_rate"],
                decay_steps=1,
                decay_rate=config["decay"],
            )
        )
    parent = _ignoring_window_arguments(
        inner.parent_class.from_config(parent_config)
    )
    if scale is not None:
        accumulating = keras.optimizers.LossScaleOptimizer(
            accumulating, **scale
        )
        parent = keras.optimizers.LossScaleOptimizer(parent, **scale)
    return accumulating, parent


def _ignoring_window_arguments(optimizer):
    """Lets `optimizer` take `apply(..., weight=, loss=)` as an
    accumulating optimizer does, and ignore them: a train step of your own
    written for the accumulating optimizer runs unchanged with the parent
    (one big batch needs no weight)."""
    apply = optimizer.apply
    apply_gradients = optimizer.apply_gradients

    def apply_without(
        grads, trainable_variables=None, *, weight=None, loss=None
    ):
        return apply(grads, trainable_variables)

    def apply_gradients_without(grads_and_vars, *, weight=None, loss=None):
        return apply_gradients(grads_and_vars)

    optimizer.apply = apply_without
    optimizer.apply_gradients = apply_gradients_without
    return optimizer


def compile_like(clone, model, optimizer):
    """Compiles `clone` with `model`'s loss, loss weights and execution
    mode, `optimizer`, no metrics and one step per execution (so that the
    weights can be read after every update)."""
    clone.compile(
        optimizer=optimizer,
        loss=model.loss,
        loss_weights=_keras_private.compiled_loss_weights(model),
        run_eagerly=model.run_eagerly,
        jit_compile=model.jit_compile,
    )
    if weighs_micro_batches(model):
        weigh_micro_batches(clone)


class _Snapshots(keras.callbacks.Callback):
    """The weights after every `every`-th training batch, as numpy."""

    def __init__(self, every):
        super().__init__()
        self.every = every
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.every == 0:
            self.weights.append(
                [np.array(w, copy=True) for w in self.model.get_weights()]
            )


def train(clone, data, batch_size, snapshot_every):
    """Fits `clone` for one epoch on `data` (`(x, y, sample_weight)`) in
    order, and returns the weights after every `snapshot_every` batches."""
    x, y, sample_weight = data
    snapshots = _Snapshots(snapshot_every)
    clone.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[snapshots],
    )
    return snapshots.weights


def take(data, indices):
    """The samples `indices` of `data`, a nest of arrays (or `None`)."""
    if data is None:
        return None
    return keras.tree.map_structure(lambda a: np.asarray(a)[indices], data)


def reordered_within(big_batch, samples, seed):
    """Indices `0..samples-1` with the samples of each consecutive big
    batch of `big_batch` shuffled among themselves."""
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [
            start + rng.permutation(big_batch)
            for start in range(0, samples, big_batch)
        ]
    )


@contextlib.contextmanager
def global_random_state_kept():
    """Puts back the random states a run draws from: Python's, numpy's,
    Keras' global seed generator's and the backend's own (torch's)."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    keras_state = _keras_private.global_seed_generator_state()
    backend_state = random_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        _keras_private.restore_global_seed_generator(keras_state)
        if backend_state is not None:
            set_random_state(backend_state)
