"""`weigh_micro_batches(model)`: exact windows in `model.fit` when
micro-batches differ.

Keras divides each batch's loss by a count: its number of loss values
(`sum_over_batch_size`), its number of valid entries when the predictions
carry a mask, or the sum of its sample weights (`mean_with_sample_weight`).
A window's big batch divides by the count of all of its samples, so the
window must weigh micro-batch j's gradient by its count n_j:
sum(n_j g_j) / sum(n_j) (see `GradientAccumulation.apply`).

Keras' trainers hand the optimizer the gradients only; the count is known
inside the model's loss computation. `weigh_micro_batches` wraps
`model.compute_loss` to read it from the losses Keras computes (the
arguments of their reduction) and hand it to the optimizer with the
micro-batch's gradients, on every backend and under `tf.distribute`.
"""

from __future__ import annotations

import weakref
from typing import Any
from typing import Sequence

import keras
import numpy as np
from keras import ops

from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers._backend import COMPILER_RETRACES_EACH_HAND_OVER
from accum_optimizers._backend import asserted_normalizer
from accum_optimizers._inner import accumulating_optimizers
from accum_optimizers._inner import accumulating_optimizers_of_model
from accum_optimizers._validation import concrete_value
from accum_optimizers._validation import validate_weighable

_DIVIDED_BY_COUNT = ("sum_over_batch_size", "mean")

# The models `weigh_micro_batches` wrapped, held weakly: a model's entry
# goes with it.
_WEIGHED: weakref.WeakSet[keras.Model] = weakref.WeakSet()


def weigh_micro_batches(model: keras.Model) -> keras.Model:
    """Makes `model.fit` weigh each micro-batch by the count its loss is
    divided by, so that a window equals its concatenated big batch when
    micro-batches differ: the epoch's short last batch, `sample_weight`
    (with the `sum_over_batch_size` and `mean_with_sample_weight`
    reductions) and masked sequences (`Embedding(mask_zero=True)`).

    Call it once, before or after `compile`; it does nothing while the
    model's optimizer does not accumulate. It wraps `model.compute_loss`
    (an override of your own is kept and called), and is not saved with
    the model: call it again after loading.

    A model with several losses (outputs) is weighed by its sample count,
    exact when each loss is divided by its number of values; masks or
    `mean_with_sample_weight` on several losses give each loss its own
    count, which one weight per micro-batch cannot honour, and raise. A
    loss with `reduction="sum"` is not divided by a count and raises.

    Args:
        model: a `keras.Model`.

    Returns:
        `model`.

    Raises:
        TypeError: if `model` is not a `keras.Model`.
        ValueError: if its accumulating optimizer keeps float16 sums,
            which refuse weighted windows; in training, if its losses give
            no single count, or a micro-batch's normalizer is negative or
            not finite.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a `keras.Model`. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    for optimizer in accumulating_optimizers(getattr(model, "optimizer", None)):
        if optimizer._has_window:
            validate_weighable(optimizer.accumulator_dtype)
    if weighs_micro_batches(model):
        return model
    compute_loss = model.compute_loss
    takes_training = _keras_private.compute_loss_takes_training(model)

    def weighed_compute_loss(
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> Any:
        kwargs = {"training": training} if takes_training else {}
        optimizers = [
            optimizer
            # A `MultiOptimizer` mapped by a function is built here, so
            # that it names the optimizers to hand the weight to.
            for optimizer in accumulating_optimizers_of_model(model)
            if optimizer._has_window
        ]
        if not training or not optimizers:
            return compute_loss(x, y, y_pred, sample_weight, **kwargs)
        _refuse_torch_compile(model)
        with _keras_private.recorded_loss_reductions() as reductions:
            loss = compute_loss(x, y, y_pred, sample_weight, **kwargs)
        weight, checked, poisoned, refused = _checked_normalizer(
            _micro_batch_weight(reductions, y_pred),
            skips=any(optimizer.skip_nonfinite for optimizer in optimizers),
        )
        if poisoned:
            # Where compiled code cannot raise, a refused weight is NaN:
            # so is the loss, which `TerminateOnNaN` stops on before the
            # window closes.
            loss = ops.where(ops.isnan(weight), float("nan"), loss)
        # Each accumulating optimizer (several under a `MultiOptimizer`)
        # weighs its own variables' gradients by the micro-batch's weight.
        for optimizer in optimizers:
            _inputs.hand_over(
                optimizer,
                _inputs.Handoff(
                    weight,
                    checked=checked,
                    may_be_invalid=poisoned,
                    refused=refused,
                ),
            )
        return loss

    model.compute_loss = weighed_compute_loss
    _keras_private.set_compute_loss_takes_training(model)
    _WEIGHED.add(model)
    # A train function traced before would keep the unweighted loss.
    model.train_function = None
    return model


def weighs_micro_batches(model: keras.Model) -> bool:
    """Whether `weigh_micro_batches(model)` wrapped `model`'s
    `compute_loss` (`check_exactness` weighs its runs' models alike).

    Args:
        model: a `keras.Model`.

    Returns:
        A bool.
    """
    return model in _WEIGHED


def _refuse_torch_compile(model: keras.Model) -> None:
    """torch's compiler (`jit_compile=True`) recompiles the train step for
    every micro-batch's hand-over, up to its recompile limit."""
    if COMPILER_RETRACES_EACH_HAND_OVER and getattr(
        model, "jit_compile", False
    ):
        raise ValueError(
            "weigh_micro_batches(model) does not support `jit_compile=True` "
            "on the torch backend: torch.compile would recompile the train "
            "step for every micro-batch. Compile the model with "
            "`jit_compile=False`. Received: jit_compile=True"
        )


def _checked_normalizer(
    weight: Any, skips: bool = False
) -> tuple[Any, Any, bool, Any]:
    """`(weight, checked, poisoned, refused)`: `weight`, refused when
    negative or not
    finite (a negative sum of sample weights under
    `mean_with_sample_weight`: a window's total weight could then be `0`
    or negative, and its mean meaningless). `0` is kept: a micro-batch
    whose samples are all masked or weigh 0. With `skips` (an optimizer
    with `skip_nonfinite=True`), a non-finite normalizer is the mark of a
    non-finite micro-batch: it is poisoned, and the micro-batch skipped,
    on every backend.

    Concrete values raise here; in a TensorFlow graph an assertion fails
    the train step before any state changes (`checked` returns the context
    the optimizer's state changes run in; else it is `None`); where
    compiled code cannot fail (JAX, XLA) the weight becomes NaN
    (`poisoned` is `True`): the micro-batch is left out of its window, and
    `refused`, a traced bool, says where it was for a refused normalizer
    (counted apart from non-finite skips, and reported at the end of
    `fit`); else `refused` is `None`.
    """
    message = (
        "weigh_micro_batches(model): a micro-batch's loss normalizer (the "
        "sum of its sample weights) must be finite and >= 0; negative "
        "sample weights are not supported."
    )
    value = concrete_value(weight)
    if value is not None and skips and not np.isfinite(value):
        return ops.convert_to_tensor(float("nan")), None, True, None
    if value is not None:
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{message} Received: normalizer={value!r}")
        return weight, None, False, None
    asserted = asserted_normalizer(weight, skips, message)
    if asserted is not None:
        return (*asserted, None)
    finite = ops.isfinite(weight)
    valid = ops.logical_and(finite, ops.greater_equal(weight, 0.0))
    # With `skips`, a non-finite normalizer marks a non-finite micro-batch,
    # skipped; a negative one is refused as without it.
    refused = ops.logical_not(valid)
    if skips:
        refused = ops.logical_and(finite, refused)
    return ops.where(valid, weight, float("nan")), None, True, refused


def _micro_batch_weight(reductions: Sequence[Any], y_pred: Any) -> Any:
    """The micro-batch's weight, from the reductions of its losses."""
    if not reductions:
        raise ValueError(
            "weigh_micro_batches(model): the model's loss computes no "
            "`keras.losses.Loss`, so the count it divides by is unknown. "
            "Pass each micro-batch's count yourself with "
            "`optimizer.apply(grads, weight=count)` in a custom train step."
        )
    counts = [_count(reduction) for reduction in reductions]
    if len(counts) == 1 and counts[0] is not None:
        return counts[0]
    exact_by_samples = all(
        reduction.mask is None
        and _standard(reduction.reduction) in _DIVIDED_BY_COUNT
        for reduction in reductions
    )
    if not exact_by_samples:
        raise ValueError(
            "weigh_micro_batches(model): the model computes "
            f"{len(reductions)} losses, and masks or "
            "`reduction='mean_with_sample_weight'` give each its own "
            "count; one weight per micro-batch cannot make all of them "
            "exact. Use one loss, or pass weights yourself with "
            "`optimizer.apply(grads, weight=...)`."
        )
    return _sample_count(y_pred)


def _count(reduction: Any) -> Any:
    """The count a Keras loss reduction divides by, as Keras computes it
    (`keras/src/losses/loss.py`), or `None` when its values are a scalar
    the loss function reduced itself."""
    loss_module = _keras_private.loss_module()
    name = _standard(reduction.reduction)
    if name not in _DIVIDED_BY_COUNT + ("mean_with_sample_weight",):
        raise ValueError(
            "weigh_micro_batches(model): a loss uses "
            f"reduction={reduction.reduction!r}, which is not divided by a "
            "count: its window would be the mean, not the sum, of its "
            "micro-batches' losses. Use 'sum_over_batch_size' or "
            "'mean_with_sample_weight'."
        )
    dtype = reduction.dtype
    values = ops.convert_to_tensor(reduction.values, dtype=dtype)
    if tuple(values.shape) in ((), (0,)):
        return None
    sample_weight = reduction.sample_weight
    mask = reduction.mask
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    if name == "mean_with_sample_weight" and (
        sample_weight is not None or mask is not None
    ):
        # A copy: on torch `apply_mask` multiplies `sample_weight` in
        # place, and autograd saved it for the loss's backward pass.
        if sample_weight is not None:
            sample_weight = ops.copy(sample_weight)
        weights = loss_module.apply_mask(
            sample_weight, mask, dtype=values.dtype, reduction=name
        )
        weights = ops.cast(weights, values.dtype)
        _, weights = loss_module.squeeze_or_expand_to_same_rank(values, weights)
        count = ops.sum(weights)
    elif mask is not None:
        count = ops.sum(ops.cast(mask, values.dtype))
    else:
        count = ops.prod(ops.convert_to_tensor(ops.shape(values), "int32"))
    return ops.cast(ops.stop_gradient(count), "float32")


def _standard(reduction: str | None) -> str:
    return _keras_private.loss_module().standardize_reduction(reduction)


def _sample_count(y_pred: Any) -> Any:
    first = next(
        leaf for leaf in keras.tree.flatten(y_pred) if leaf is not None
    )
    return ops.cast(ops.shape(first)[0], "float32")
