"""The known causes that keep an accumulated run from being the big batch,
looked for in the user's model, optimizer, data and callbacks.

Each `_<cause>` function returns a `Cause` when it finds its cause, else
`None`; `diagnose` runs them all.
"""

import math

import keras
import numpy as np

from accum_optimizers import _keras_private
from accum_optimizers._backend import EMBEDDING_GRADIENTS_ARE_SPARSE
from accum_optimizers.callbacks import AccumulationLogger
from accum_optimizers.callbacks import FlushAccumulation
from accum_optimizers.check._report import Cause
from accum_optimizers.check._runs import is_random_layer
from accum_optimizers.layers import AccumBatchNormalization
from accum_optimizers.weighting import weighs_micro_batches

_DIVIDED_BY_COUNT = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class Setup:
    """What the diagnosis looks at.

    Args:
        model: the user's model.
        optimizer: its accumulating optimizer (a `LossScaleOptimizer`
            around it included).
        accum_iters: `k`, an int.
        batch_size: `b`.
        samples: the number of samples the user trains on per epoch.
        callbacks: the callbacks the user trains with.
        loss_reductions: the `LossReduction`s of one micro-batch's loss.
        window_loss_missing: Boolean. The accumulating run's
            `window_loss` is NaN: its train step handed over no loss.
        random_layers_off: Boolean. The runs called random layers with
            `training=False`.
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)

    @property
    def weighs(self):
        return weighs_micro_batches(self.model)

    def layers(self, kind):
        return [
            layer
            for layer in _keras_private.sublayers(self.model)
            if isinstance(layer, kind)
        ]


def _names(layers):
    return ", ".join(repr(layer.name) for layer in layers)


def _batch_statistics(setup):
    layers = setup.layers(keras.layers.BatchNormalization)
    if not layers:
        return None
    plain = [
        layer
        for layer in layers
        if not (
            isinstance(layer, AccumBatchNormalization)
            and layer.accum_iters == setup.accum_iters
        )
    ]
    remedy = (
        "In training a batch-statistics layer normalizes each micro-batch "
        "with its own mean and variance, by design: no optimizer can make "
        "that the big batch's. "
    )
    if plain:
        remedy += (
            "Its moving statistics also move once per micro-batch: "
            "`accum_optimizers.layers.with_accum_batch_norm(model, "
            f"accum_iters={setup.accum_iters})` (or "
            f"`AccumBatchNormalization(accum_iters={setup.accum_iters})`) "
            "moves them once per window, as the big batch does. "
        )
    else:
        remedy += "Its moving statistics are the big batch's already. "
    remedy += (
        "For an exact window, normalize per sample instead "
        "(`LayerNormalization`, `GroupNormalization`)."
    )
    return Cause("batch_statistics", f"layers {_names(layers)}", remedy)


def _random_layers(setup):
    layers = [
        layer
        for layer in _keras_private.sublayers(setup.model)
        if is_random_layer(layer)
    ]
    if not layers:
        return None
    remedy = (
        "Random layers draw their numbers per call: micro-batches draw "
        "other numbers than the big batch (from the same distribution), "
        "by design. "
    )
    if setup.random_layers_off:
        remedy += (
            "The check called them with `training=False` in every run, so "
            "none of the drift above comes from them."
        )
    else:
        remedy += (
            "The check could not switch them off in a model class of your "
            "own: the drift above includes their different draws. Check a "
            "Sequential or Functional version of the model to separate "
            "the two."
        )
    return Cause("random_layers", f"layers {_names(layers)}", remedy)


def _short_micro_batch(setup):
    short = setup.samples % setup.batch_size
    if not short or setup.weighs:
        return None
    return Cause(
        "short_micro_batch",
        f"{setup.samples} samples at batch_size={setup.batch_size}: the "
        f"last micro-batch has {short}",
        "Its mean gradient would count as much as a full micro-batch's in "
        "its window. Call `accum_optimizers.weigh_micro_batches(model)` "
        "to weigh each micro-batch by its samples.",
    )


def _partial_window(setup):
    micro_batches = math.ceil(setup.samples / setup.batch_size)
    left = micro_batches % setup.accum_iters
    flushes = any(isinstance(c, FlushAccumulation) for c in setup.callbacks)
    if not left or flushes:
        return None
    return Cause(
        "partial_window",
        f"{micro_batches} micro-batches per epoch at "
        f"accum_iters={setup.accum_iters}: {left} left at the epoch's "
        "end",
        "Without `FlushAccumulation` they are carried into the next "
        "epoch's first window, a group the big-batch run never forms. "
        "Pass `callbacks=[accum_optimizers.FlushAccumulation()]` to `fit` "
        "(with `weigh_micro_batches` when the last micro-batch is short).",
    )


def _loss_counts(setup):
    reductions = setup.loss_reductions
    names = [_reduction_name(r.reduction) for r in reductions]
    unweighable = [n for n in names if n not in _DIVIDED_BY_COUNT]
    if unweighable:
        return Cause(
            "loss_not_divided_by_count",
            f"reduction={unweighable[0]!r}",
            "A loss that is not divided by its count makes the big batch's "
            f"gradient the sum over its micro-batches, {setup.accum_iters} "
            "times the window's mean, and `weigh_micro_batches` cannot "
            "weigh it. Use the default reduction 'sum_over_batch_size', or "
            f"divide the learning rate by {setup.accum_iters}.",
        )
    # Counts that differ between micro-batches: valid entries, or summed
    # sample weights.
    counts_differ = any(
        r.mask is not None
        or (name == "mean_with_sample_weight" and r.sample_weight is not None)
        for name, r in zip(names, reductions)
    )
    if not counts_differ:
        return None
    if len(reductions) > 1:
        return Cause(
            "loss_counts_per_output",
            f"{len(reductions)} losses, masked or weighted",
            "Each loss is divided by its own count (valid entries, summed "
            "sample weights), which one weight per micro-batch cannot "
            "honour: `weigh_micro_batches` refuses it. Use one loss, or "
            "pass each micro-batch's weights yourself with "
            "`optimizer.apply(grads, weight=...)` in a custom loop.",
        )
    if setup.weighs:
        return None
    if reductions[0].mask is not None:
        where = "a masked loss"
    else:
        where = "reduction='mean_with_sample_weight' with sample weights"
    return Cause(
        "unweighed_loss_counts",
        where,
        "Each micro-batch's loss is divided by its own count (valid "
        "entries or summed sample weights), the big batch's by the sum of "
        "them. Call `accum_optimizers.weigh_micro_batches(model)`.",
    )


def _reduction_name(reduction):
    return _keras_private.loss_module().standardize_reduction(reduction)


def _sparse_embedding(setup):
    if not EMBEDDING_GRADIENTS_ARE_SPARSE:
        return None
    layers = [
        layer
        for layer in setup.layers(keras.layers.Embedding)
        if layer.trainable
    ]
    parent = _inner(setup.optimizer).parent_class
    if not layers or not _updates_sparse_rows_apart(parent):
        return None
    return Cause(
        "sparse_embedding_gradients",
        f"layers {_names(layers)} on TensorFlow with {parent.__name__}",
        "On TensorFlow an Embedding's gradient is sparse (IndexedSlices), "
        f"and Keras' {parent.__name__} applied to it treats the rows of "
        "repeated ids apart, which is not its dense update of the big "
        "batch; the window adds the micro-batches' gradients densely, so "
        "it applies the dense update. The difference is Keras' sparse "
        "path: check on JAX or torch, whose gradients are dense, to see "
        "the window's own drift.",
    )


def _updates_sparse_rows_apart(parent_class):
    """Whether `parent_class` (on TensorFlow) updates a variable otherwise
    from a sparse gradient with a repeated row than from its dense sum."""
    import tensorflow as tf

    values = np.arange(12, dtype="float32").reshape(4, 3) / 10
    results = []
    for sparse in (True, False):
        variable = keras.Variable(np.full((5, 3), 0.5, "float32"))
        gradient = tf.IndexedSlices(
            tf.constant(values), tf.constant([0, 2, 2, 4]), tf.constant([5, 3])
        )
        if not sparse:
            gradient = tf.convert_to_tensor(gradient)
        parent_class().apply([gradient], [variable])
        results.append(variable.numpy())
    return not np.allclose(results[0], results[1], rtol=1e-6, atol=1e-7)


def _inner(optimizer):
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _loss_scale(setup):
    wrapped = isinstance(setup.optimizer, keras.optimizers.LossScaleOptimizer)
    policies = {
        layer.dtype_policy.name
        for layer in [setup.model, *_keras_private.sublayers(setup.model)]
    }
    if not wrapped and "mixed_float16" not in policies:
        return None
    where = (
        "the mixed_float16 dtype policy (compile wraps the optimizer in a "
        "LossScaleOptimizer)"
        if "mixed_float16" in policies
        else "a LossScaleOptimizer"
    )
    return Cause(
        "dynamic_loss_scale",
        where,
        "A micro-batch whose scaled gradients overflow is dropped and the "
        "scale lowered, where the big batch drops a whole update; and "
        "float16 adds its own round-off. The runs agree while no step "
        "overflows, to float16 precision. Check in float32 "
        "(`keras.config.set_dtype_policy('float32')` before building the "
        "model) to see the window's own drift.",
    )


def _train_step_without_loss(setup):
    overrides = type(setup.model).train_step is not keras.Model.train_step
    if not (overrides and setup.window_loss_missing):
        return None
    return Cause(
        "train_step_without_loss",
        f"{type(setup.model).__name__}.train_step",
        "The model's own `train_step` hands the optimizer no loss: "
        "`optimizer.window_loss` (and `AccumulationLogger`'s) is NaN, and "
        "`weigh_micro_batches` cannot weigh a loss computed outside "
        "`compute_loss`. Call `self.optimizer.apply(grads, "
        "self.trainable_variables, loss=loss)` (with `weight=` for uneven "
        "micro-batches) in it.",
    )


def _logger_with_steps_per_execution(setup):
    steps = getattr(setup.model, "steps_per_execution", 1) or 1
    logs = any(isinstance(c, AccumulationLogger) for c in setup.callbacks)
    if steps <= 1 or not logs or setup.accum_iters % steps == 0:
        return None
    return Cause(
        "logger_steps_per_execution",
        f"AccumulationLogger with steps_per_execution={steps} and "
        f"accum_iters={setup.accum_iters}",
        "The logger reads the optimizer once per execution of "
        f"{steps} micro-batches: a window that closes inside one is read "
        "late, and when several close in one, `logger.windows` records "
        "only the last. Use a `steps_per_execution` that divides "
        "`accum_iters`.",
    )


_CHECKS = (
    _batch_statistics,
    _random_layers,
    _short_micro_batch,
    _partial_window,
    _loss_counts,
    _sparse_embedding,
    _loss_scale,
    _train_step_without_loss,
    _logger_with_steps_per_execution,
)


def diagnose(setup):
    """The `Cause`s found in `setup` (a `Setup`), in a fixed order."""
    return [c for c in (check(setup) for check in _CHECKS) if c is not None]
