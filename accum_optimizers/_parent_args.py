"""The parent optimizer's arguments, as an accumulating class receives them:
bound to the parent's signature, with Keras 2's spellings (`lr`,
`epsilon=None`, `decay`) translated or refused, and Keras' own
`gradient_accumulation_steps` refused beside `accum_iters`."""

import inspect
import warnings

from keras import config as keras_config

from accum_optimizers import schedules


def bind_parent_arguments(optimizer_class, args, kwargs, accumulation):
    """The parent's `inspect.BoundArguments` (the first one `self`), so that
    what the user passed explicitly is known (`lr` with `learning_rate` is
    refused even when `learning_rate` equals its default).

    Args:
        optimizer_class: the accumulating class (its `parent_class` and
            name).
        args: the positional arguments passed, in the parent's order.
        kwargs: the parent's keyword arguments passed.
        accumulation: the accumulation arguments, checked (`_args.checked`).
    """
    signature = inspect.signature(optimizer_class.parent_class.__init__)
    try:
        arguments = signature.bind_partial(None, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{optimizer_class.__name__}(): {error}") from None
    _translate_keras2(arguments.arguments, accumulation)
    _refuse_accumulating_twice(arguments.arguments, accumulation)
    return arguments


def _translate_keras2(explicit, accumulation):
    """Keras 2's `lr` and `epsilon=None` into `explicit` (the arguments
    passed, by name), with a warning for `lr` and `decay`."""
    lr = accumulation["lr"]
    if lr is not None:
        warnings.warn(
            "`lr` is the Keras 2 spelling of `learning_rate`; pass "
            "`learning_rate` instead.",
            DeprecationWarning,
            stacklevel=5,
        )
        if "learning_rate" in explicit:
            raise ValueError(
                "Pass either `learning_rate` or its Keras 2 alias `lr`, "
                "not both. Received: "
                f"learning_rate={explicit['learning_rate']!r}, lr={lr!r}"
            )
        explicit["learning_rate"] = lr
    if explicit.get("epsilon", 0) is None:
        # Keras 2 spelled "Keras' default epsilon" as `epsilon=None`.
        explicit["epsilon"] = keras_config.epsilon()
    if accumulation["decay"] is not None:
        warnings.warn(
            "`decay` is the Keras 2 time decay; in Keras 3 pass "
            "`learning_rate=keras.optimizers.schedules.InverseTimeDecay("
            "learning_rate, decay_steps=1, decay_rate=decay)` instead.",
            DeprecationWarning,
            stacklevel=5,
        )


def _refuse_accumulating_twice(explicit, accumulation):
    """Refuses Keras' own `gradient_accumulation_steps` beside windows."""
    accum_iters = accumulation["accum_iters"]
    steps = explicit.get("gradient_accumulation_steps")
    windows = isinstance(accum_iters, schedules.AccumSchedule) or (
        accum_iters > 1
    )
    if windows and steps:
        raise ValueError(
            "Pass either `accum_iters` or Keras' own "
            "`gradient_accumulation_steps`, not both: together they would "
            "accumulate twice. Received: "
            f"accum_iters={accum_iters}, "
            f"gradient_accumulation_steps={steps!r}"
        )
