"""`accumulating(cls)`, and an accumulating class for every Keras optimizer.

```python
from accum_optimizers import AdamWAccumulate, accumulating

optimizer = AdamWAccumulate(1e-3, weight_decay=0.01, accum_iters=4)
MyAccumulate = accumulating(MyOptimizer)  # any keras.optimizers.Optimizer
```
"""

from __future__ import annotations

import inspect
from typing import Any

import keras
from keras.saving import register_keras_serializable

from accum_optimizers import _args
from accum_optimizers import _keras_private
from accum_optimizers._accumulation import GradientAccumulation
from accum_optimizers._keras_private import versions as keras_versions

_PACKAGE = "accum_optimizers"

# One class per parent: calling `accumulating` twice returns the same class.
_CLASSES: dict[type, type[keras.optimizers.Optimizer]] = {}

_NOT_ACCUMULABLE = _keras_private.wrapper_optimizer_classes()


def accumulating(
    optimizer_class: type[keras.optimizers.Optimizer],
) -> type[keras.optimizers.Optimizer]:
    """Returns the accumulating subclass of a Keras optimizer class.

    The class is named `<Name>Accumulate`, registered as Keras-serializable
    (package `"accum_optimizers"`), and takes every argument of
    `optimizer_class`, positionally in its order, plus the keyword-only
    accumulation arguments (`accum_iters`, `skip_nonfinite`,
    `accumulator_dtype`, and the Keras 2 aliases `lr` and `decay`). Over
    `accum_iters` calls to `apply` it adds up the gradients, then applies
    their mean once through
    `optimizer_class`'s own update, so `accum_iters` micro-batches of size
    `b` train exactly like one batch of `accum_iters * b`. Calling it twice
    with one class returns the same class; an accumulating class is
    returned as it is. The class's `parent_class` is `optimizer_class`.

    ```python
    class MyOptimizer(keras.optimizers.Optimizer):
        ...  # build() and update_step(), as any Keras optimizer

    MyOptimizerAccumulate = accum_optimizers.accumulating(MyOptimizer)
    model.compile(optimizer=MyOptimizerAccumulate(accum_iters=4), ...)
    keras.saving.load_model(
        path, custom_objects={"MyOptimizerAccumulate": MyOptimizerAccumulate}
    )
    ```

    Args:
        optimizer_class: a subclass of `keras.optimizers.Optimizer` (not a
            wrapper such as `LossScaleOptimizer` or `MultiOptimizer`: wrap
            accumulating optimizers in those instead).

    Returns:
        The accumulating class.

    Raises:
        TypeError: if `optimizer_class` is not a subclass of
            `keras.optimizers.Optimizer`, or is a wrapper of optimizers.
        ValueError: if another class already registered the name
            `<Name>Accumulate` in the package `"accum_optimizers"`.
    """
    if isinstance(optimizer_class, type) and issubclass(
        optimizer_class, GradientAccumulation
    ):
        return optimizer_class
    if not (
        isinstance(optimizer_class, type)
        and issubclass(optimizer_class, keras.optimizers.Optimizer)
    ):
        raise TypeError(
            "`optimizer_class` must be a subclass of "
            "`keras.optimizers.Optimizer`. Received: "
            f"optimizer_class={optimizer_class!r}"
        )
    if issubclass(optimizer_class, _NOT_ACCUMULABLE):
        raise TypeError(
            f"`{optimizer_class.__name__}` wraps other optimizers: wrap "
            "accumulating optimizers in it instead. Received: "
            f"optimizer_class={optimizer_class!r}"
        )
    if optimizer_class in _CLASSES:
        return _CLASSES[optimizer_class]
    name = f"{optimizer_class.__name__}Accumulate"

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        GradientAccumulation.__init__(self, *args, **kwargs)

    # The signature users, `help()` and the API docs see: the parent's
    # arguments in its order, then the accumulation arguments.
    __init__.__signature__ = _signature(  # type: ignore[attr-defined]
        optimizer_class
    )
    __init__.__qualname__ = f"{name}.__init__"
    cls = type(
        name,
        (GradientAccumulation, _keras_private.fused_class(optimizer_class)),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": _docstring(optimizer_class),
            "__init__": __init__,
            "_parent": optimizer_class,
        },
    )
    registered = keras.saving.get_registered_object(f"{_PACKAGE}>{name}")
    if registered is not None:
        raise ValueError(
            f"Cannot make `{name}` for {optimizer_class!r}: that name is "
            "already registered (for "
            f"{getattr(registered, 'parent_class', registered)!r}). Rename "
            "one of the two optimizer classes."
        )
    _CLASSES[optimizer_class] = register_keras_serializable(_PACKAGE)(cls)
    return cls


def _signature(
    optimizer_class: type[keras.optimizers.Optimizer],
) -> inspect.Signature:
    """The parent's signature plus the keyword-only accumulation args."""
    parameters = list(
        inspect.signature(optimizer_class.__init__).parameters.values()
    )
    keyword = inspect.Parameter.KEYWORD_ONLY
    extra = _args.signature_parameters()
    var_keyword = [
        p for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD
    ]
    others = [p for p in parameters if p not in var_keyword]
    positional = [p for p in others if p.kind is not keyword]
    keyword_only = [p for p in others if p.kind is keyword]
    return inspect.Signature(
        positional + keyword_only + extra + var_keyword,
        return_annotation=None,
    )


def _keyword_list() -> str:
    names = [f"`{name}`" for name in _args.NAMES]
    return ", ".join(names[:-1]) + f" and {names[-1]}"


def _docstring(optimizer_class: type) -> str:
    parent = _keras_private.public_name(optimizer_class)
    name = optimizer_class.__name__
    parent_args, parent_rest = _split_args(_parent_docstring(optimizer_class))
    return (
        f"{name} that updates the weights once per `accum_iters` "
        "micro-batches.\n\n"
        f"Each `apply` adds its gradients into per-variable sums; every "
        f"`accum_iters`-th call applies their mean through `{parent}`'s own "
        f"update, so `accum_iters` micro-batches of size `b` train exactly "
        f"like one batch of size `accum_iters * b`. `iterations` counts "
        "applied updates, so learning-rate schedules, EMA and bias "
        "corrections see the big batch's step numbers. It takes every "
        f"argument of `{parent}`, positionally in its order or by name, "
        f"plus the keyword-only {_keyword_list()}.\n\n"
        "```python\n"
        f"model.compile(optimizer={name}Accumulate(accum_iters=4), ...)\n"
        "model.fit(x, y, batch_size=16)  # trains like batch_size=64\n"
        "```\n\n"
        "Args:\n"
        f"{parent_args}"
        f"{_args.docstring(f'`{parent}`')}\n\n"
        "Attributes:\n"
        f"    parent_class: `{parent}`, whose update is applied once per "
        "window.\n"
        f"{_FLUSH_AT_TRAIN_END}\n\n"
        f"`{parent}`'s documentation:\n\n"
        f"{parent_rest}\n"
    )


def _split_args(text: str) -> tuple[str, str]:
    """`(args, rest)`: the lines of a Google-style docstring's `Args:`
    section (indented, each ending in a newline) and the docstring without
    that section."""
    lines = text.splitlines()
    if "Args:" not in lines:
        return "", text
    start = lines.index("Args:")
    end = start + 1
    while end < len(lines) and (
        not lines[end].strip() or lines[end].startswith(" ")
    ):
        end += 1
    args = [line for line in lines[start + 1 : end] if line.strip()]
    rest = lines[:start] + lines[end:]
    return "".join(f"{line}\n" for line in args), "\n".join(rest).strip()


# `GradientAccumulation.flush_at_train_end`, in the classes' docstrings.
_FLUSH_AT_TRAIN_END = """\
    flush_at_train_end: Boolean. Whether something flushes the pending
        window when training ends; `fit`'s end then leaves the window to it
        instead of warning that one is pending.
        `FlushAccumulation(at_train_end=True)` sets it for the length of
        `fit`. Defaults to `False`."""


_BASE_ARGS = """\
weight_decay: Float. If set, weight decay is applied.
    clipnorm: Float. If set, each gradient is clipped to this norm.
    clipvalue: Float. If set, each gradient is clipped to this value.
    global_clipnorm: Float. If set, the gradients are clipped so that
        their global norm is no higher than this value.
    use_ema: Boolean. Whether to keep a moving average of the weights.
    ema_momentum: Float. Momentum of that moving average.
    ema_overwrite_frequency: Int or `None`. Every how many updates the
        weights are overwritten by their moving average.
    loss_scale_factor: Float or `None`. Loss scale; gradients are divided
        by it before they are applied.
    gradient_accumulation_steps: Keras' own accumulation; refused together
        with `accum_iters > 1`.
    name: String. The name of the optimizer."""


def _parent_docstring(optimizer_class: type) -> str:
    text = inspect.cleandoc(optimizer_class.__doc__ or "")
    # Keras' Muon leaves its template's placeholder unfilled.
    return text.replace("{{base_optimizer_keyword_args}}", _BASE_ARGS)


# An accumulating class for every optimizer the installed Keras ships. Those
# that every supported Keras has are declared by name; those Keras added
# later (`keras_versions.OPTIMIZERS_ADDED_IN`), or that a newer Keras ships,
# exist only where the installed Keras has their parent.
AdadeltaAccumulate = accumulating(keras.optimizers.Adadelta)
AdafactorAccumulate = accumulating(keras.optimizers.Adafactor)
AdagradAccumulate = accumulating(keras.optimizers.Adagrad)
AdamAccumulate = accumulating(keras.optimizers.Adam)
AdamWAccumulate = accumulating(keras.optimizers.AdamW)
AdamaxAccumulate = accumulating(keras.optimizers.Adamax)
FtrlAccumulate = accumulating(keras.optimizers.Ftrl)
LambAccumulate = accumulating(keras.optimizers.Lamb)
LionAccumulate = accumulating(keras.optimizers.Lion)
MuonAccumulate = accumulating(keras.optimizers.Muon)
NadamAccumulate = accumulating(keras.optimizers.Nadam)
RMSpropAccumulate = accumulating(keras.optimizers.RMSprop)
SGDAccumulate = accumulating(keras.optimizers.SGD)

# `{"AdamAccumulate": AdamAccumulate, ...}`: every accumulating class made
# here, one per optimizer the installed Keras ships.
OPTIMIZER_CLASSES = {
    f"{name}Accumulate": accumulating(parent)
    for name, parent in _keras_private.keras_optimizer_classes().items()
}
globals().update(OPTIMIZER_CLASSES)

# Optimizers Keras added after the oldest supported release that the
# installed Keras lacks: `{"ScheduleFreeAdamWAccumulate": "ScheduleFreeAdamW"}`.
MISSING_OPTIMIZER_CLASSES = {
    f"{name}Accumulate": name
    for name in keras_versions.OPTIMIZERS_ADDED_IN
    if name not in _keras_private.keras_optimizer_classes()
}


def __getattr__(name: str) -> Any:
    if name in MISSING_OPTIMIZER_CLASSES:
        raise AttributeError(
            keras_versions.missing_optimizer_message(
                MISSING_OPTIMIZER_CLASSES[name]
            )
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
