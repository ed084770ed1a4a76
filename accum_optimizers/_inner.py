"""The accumulating optimizers a model's optimizer applies through: itself,
the one a `LossScaleOptimizer` wraps, or those of a `MultiOptimizer`; what
sizes each one's windows; a `MultiOptimizer`'s update count; a model's,
checked for the callbacks.
Used by the callbacks, the planner and `weigh_micro_batches`."""

import keras

from accum_optimizers import _keras_private
from accum_optimizers._accumulation import GradientAccumulation
from accum_optimizers.layers import AccumBatchNormalization


def accumulating_optimizers(optimizer):
    """The accumulating optimizers `optimizer` applies through, those with
    `accum_iters=1` included: itself, the one a `LossScaleOptimizer` wraps
    (`compile` adds one under `mixed_float16`), or those of a
    `MultiOptimizer`, in its order.

    Args:
        optimizer: a `keras.optimizers.Optimizer`, or `None`.

    Returns:
        A list of `GradientAccumulation` optimizers, possibly empty.
    """
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if _keras_private.is_multi_optimizer(optimizer):
        inner = optimizer.optimizers
    else:
        inner = [optimizer]
    return [o for o in inner if isinstance(o, GradientAccumulation)]


def count_updates_in_multi_optimizer(optimizer):
    """Sets a `MultiOptimizer`'s `iterations` to the applied updates of its
    accumulating optimizers: after each call of its patched `apply`
    (`_wrappers.py`), and from the callbacks, for a `flush()` run since.

    Keras' `MultiOptimizer.apply` adds 1 to its `iterations` on every call,
    a micro-batch. When every inner optimizer accumulates with the same
    `accum_iters`, they update together, and `iterations` is their count.
    Otherwise they count differently, and `iterations` is left as Keras
    counts it. Does nothing for other optimizers.

    Args:
        optimizer: a `keras.optimizers.Optimizer`; a `LossScaleOptimizer`
            is looked through (its `iterations` are its inner one's).
    """
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    reference = _shared_window_optimizer(optimizer)
    if reference is not None and optimizer.built and reference.built:
        # A copy: JAX would hand both variables one buffer, which the next
        # compiled step donates twice.
        optimizer.iterations.assign(keras.ops.copy(reference.iterations))


def _shared_window_optimizer(optimizer):
    """The first inner optimizer of a `MultiOptimizer` whose inner
    optimizers all accumulate with the same `accum_iters` (they update
    together), or `None`."""
    if not _keras_private.is_multi_optimizer(optimizer):
        return None
    accumulating = accumulating_optimizers(optimizer)
    if not accumulating or len(accumulating) != len(optimizer.optimizers):
        return None
    first = window_of(accumulating[0])
    if any(window_of(o) != first for o in accumulating[1:]):
        return None
    return accumulating[0]


def window_of(optimizer):
    """What sizes `optimizer`'s windows, comparable between optimizers:
    its `accum_iters` (an int, a dict, or a schedule's class name and
    config) where it keeps a window, Keras' `gradient_accumulation_steps`
    where it has them, else 1 (an update per micro-batch)."""
    if not (
        isinstance(optimizer, GradientAccumulation) and optimizer._has_window
    ):
        return getattr(optimizer, "gradient_accumulation_steps", None) or 1
    accum_iters = optimizer.accum_iters
    if isinstance(accum_iters, (int, dict)):
        return accum_iters
    try:
        return type(accum_iters).__name__, accum_iters.get_config()
    except NotImplementedError:
        return accum_iters  # a schedule without a config: itself


def shown_window(window):
    """A `window_of` as messages name it: the int or dict, or the
    schedule's class name."""
    if isinstance(window, (int, dict)):
        return repr(window)
    name = window[0] if isinstance(window, tuple) else type(window).__name__
    return f"{name}(...)"


def accumulating_of_model(model, caller):
    """The accumulating optimizers of `model` (see
    `accumulating_optimizers_of_model`); raises, naming `caller`, if there
    is none."""
    optimizers = accumulating_optimizers_of_model(model)
    if not optimizers:
        raise ValueError(
            f"{caller} needs an accumulating optimizer (an `accum_optimizers` "
            "class or `accumulating(cls)`, possibly inside a "
            "`LossScaleOptimizer` or `MultiOptimizer`)."
            f"{unknown_optimizers_hint(model.optimizer)} Received: "
            f"optimizer={model.optimizer!r}"
        )
    return optimizers


def accumulating_optimizers_of_model(model):
    """`accumulating_optimizers(model.optimizer)`, the optimizer built
    first, on the built model's trainable variables, where it holds a
    `MultiOptimizer` mapped by a function: that one names its optimizers
    only once built, which TensorFlow does in the first traced step, after
    the callbacks' `on_train_begin`."""
    from accum_optimizers import _wrappers

    optimizer = model.optimizer
    if unnamed_multi_optimizer(optimizer) is not None and model.built:
        optimizer.build(model.trainable_variables)
    accumulating = accumulating_optimizers(optimizer)
    if accumulating:
        # The wrappers it met (`_wrappers.cooperate`), and on TensorFlow a
        # `LossScaleOptimizer` around a `MultiOptimizer`, met only here.
        _wrappers.cooperate_through(optimizer)
    return accumulating


def unknown_optimizers_hint(optimizer):
    """A sentence for an error that found no accumulating optimizer in
    `optimizer`, where a `MultiOptimizer` in it has not named its
    optimizers yet; else `""`."""
    if unnamed_multi_optimizer(optimizer) is None:
        return ""
    return (
        " A `MultiOptimizer` mapped by a function names its optimizers only "
        "once built: give it a `keras.optimizers.OptimizerMap`."
    )


def unnamed_multi_optimizer(optimizer):
    """The `MultiOptimizer` `optimizer` is (or a `LossScaleOptimizer`
    wraps) where it has not named its optimizers yet (mapped by a function,
    it names them once built), else `None`."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if (
        _keras_private.is_multi_optimizer(optimizer)
        and not optimizer.built
        and not optimizer.optimizers
    ):
        return optimizer
    return None


def refuse_skips_with_accum_batch_norm(model, optimizers):
    """`AccumBatchNormalization` counts its windows in the forward pass, so
    a micro-batch the optimizer skips afterwards would still be in the
    layer's statistics, and its windows would fall out of step with the
    optimizer's."""
    if not any(o.skip_nonfinite for o in optimizers):
        return
    for layer in _windowed_batch_norm_layers(model):
        raise ValueError(
            "`skip_nonfinite=True` cannot be combined with "
            f"AccumBatchNormalization layer '{layer.name}' "
            f"(accum_iters={layer.accum_iters}): the layer adds every "
            "micro-batch to its window in the forward pass, before the "
            "optimizer decides to skip it."
        )


def refuse_accum_batch_norm_in_planning(model):
    """`fit_to_memory` and `plan_micro_batch` choose the window size, and
    recovery re-cuts the window and runs a failed micro-batch again, but an
    `AccumBatchNormalization` counts its own window, of its own
    `accum_iters`, in the forward pass."""
    for layer in _windowed_batch_norm_layers(model):
        raise ValueError(
            "fit_to_memory cannot plan a model with "
            f"AccumBatchNormalization layer '{layer.name}' "
            f"(accum_iters={layer.accum_iters}): the layer counts its "
            "own windows in the forward pass, so the window "
            "fit_to_memory chooses, and re-cuts after an out-of-memory "
            "error, would fall out of step with them, and a micro-batch "
            "run again after the error would enter its statistics "
            "twice. Use `keras.layers.BatchNormalization`, or "
            "`model.fit` with a fixed `accum_iters`."
        )


def _windowed_batch_norm_layers(model):
    """The model's `AccumBatchNormalization` layers that keep a window."""
    return [
        layer
        for layer in _keras_private.sublayers(model)
        if isinstance(layer, AccumBatchNormalization) and layer.accum_iters > 1
    ]
