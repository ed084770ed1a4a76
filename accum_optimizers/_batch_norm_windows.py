"""The windows of `AccumBatchNormalization` layers beside their optimizer's:
a layer whose `accum_iters` differs moves its moving statistics on other
training calls than the weights."""

import warnings
import weakref
from typing import Any

# Every built `AccumBatchNormalization`, held weakly: an accumulating
# optimizer built on its weights compares their windows once, when it is
# built (`warn_of_other_windows`), at no cost per step.
BUILT: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_of_other_windows(optimizer, variables):
    """Warns of each `AccumBatchNormalization` whose trainable weights are
    among `variables` and whose windows differ from `optimizer`'s.

    Its moving statistics would move on other training calls than the
    weights. A layer without trainable weights (`center=False,
    scale=False`, or frozen) is not matched: a frozen one moves nothing.

    Args:
        optimizer: an accumulating optimizer (with `name` and
            `accum_iters`: an int, a dict or a schedule), being built.
        variables: the variables it is built with.
    """
    accum_iters = optimizer.accum_iters
    if isinstance(accum_iters, dict) and len(accum_iters) == 1:
        accum_iters = next(iter(accum_iters.values()))  # One size for good.
    # `id`s: a `keras.Variable`'s `==` compares values.
    built_on = {id(v) for v in variables}
    for layer in list(BUILT):
        if layer.accum_iters == accum_iters or not any(
            id(w) in built_on for w in layer.trainable_weights
        ):
            continue
        warnings.warn(
            f"AccumBatchNormalization layer {layer.name!r} has "
            f"accum_iters={layer.accum_iters}, but optimizer "
            f"{optimizer.name!r} has accum_iters={optimizer.accum_iters!r}: "
            "the moving statistics move on other steps than the weights. "
            "Give the layer the optimizer's `accum_iters` "
            "(`with_accum_batch_norm(model, accum_iters)`), times the "
            "number of times the model calls it per step.",
            stacklevel=3,
        )
