"""The accumulation arguments, specified once.

`ARGUMENTS` drives everything that lists them: the checks in
`GradientAccumulation.__init__`, the signature of every accumulating class
(`signature_parameters`), their docstrings (`docstring`) and `get_config`
(`config_names`). An argument added here appears in all four.
"""

import dataclasses
import inspect
from typing import Any
from typing import Callable

import keras
import numpy as np

from accum_optimizers import _settable
from accum_optimizers import schedules
from accum_optimizers._validation import is_real_number
from accum_optimizers._validation import validate_accumulator_dtype
from accum_optimizers._validation import validate_decay


@dataclasses.dataclass(frozen=True)
class Argument:
    """One keyword-only accumulation argument.

    Args:
        name: the keyword.
        default: its default value.
        doc: its docstring entry (indented continuation lines); `{parent}`
            names the parent optimizer.
        check: maps the value passed to the value kept, raising on a bad
            one.
        in_config: whether `get_config` returns it (`lr` is folded into
            `learning_rate` instead).
        settable: maps `(optimizer, checked value)` to the value the
            optimizer keeps when it is set as an attribute, raising where
            the optimizer cannot take it now (`_settable`).
        read: maps the optimizer to the attribute's value, where it is
            not the value kept (`lr` reads `learning_rate`).
        annotation: its type, as the signature shows it.
    """

    name: str
    default: Any
    doc: str
    check: Callable[[Any], Any]
    in_config: bool = True
    settable: Callable[[Any, Any], Any] = _settable.taken
    read: Callable[[Any], Any] | None = None
    annotation: str = "Any"


class Attribute:
    """An accumulation argument as an attribute of the optimizer: a value
    set after construction is checked as the constructor checks it, then
    as the optimizer can take it now (`Argument.settable`), and refused
    naming the argument and the value."""

    def __init__(self, argument):
        self.argument = argument
        self.__doc__ = argument.doc.format(parent="the parent optimizer")

    def __get__(self, optimizer, owner=None):
        if optimizer is None:
            return self
        if self.argument.read is not None:
            return self.argument.read(optimizer)
        try:
            return optimizer.__dict__[_settable.key(self.argument.name)]
        except KeyError:
            raise AttributeError(self.argument.name) from None

    def __set__(self, optimizer, value):
        argument = self.argument
        kept = argument.settable(optimizer, argument.check(value))
        optimizer.__dict__[_settable.key(argument.name)] = kept


def add_attributes(cls):
    """Makes every accumulation argument an `Attribute` of `cls`."""
    for argument in ARGUMENTS:
        setattr(cls, argument.name, Attribute(argument))


def _bool_check(name):
    """The check of the bool argument `name`: numpy bools taken, anything
    else refused, naming it."""

    def check(value):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(
                f"`{name}` must be a bool. Received: {name}={value!r}"
            )
        return bool(value)

    return check


def _check_jit_compile(value):
    if isinstance(value, str) and value == "auto":
        return "auto"
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            '`jit_compile` must be a bool or "auto". Received: '
            f"jit_compile={value!r}"
        )
    return bool(value)


def _check_noise_scale_momentum(value):
    if not is_real_number(value) or not 0 <= value < 1:
        raise ValueError(
            "`noise_scale_momentum` must be a number in [0, 1). Received: "
            f"noise_scale_momentum={value!r}"
        )
    return float(value)


def _keep(value):
    return value


ARGUMENTS = (
    Argument(
        "accum_iters",
        1,
        """Integer >= 1, dict or `AccumSchedule`. Number of
        micro-batches (`apply` calls) whose gradients are averaged into
        one update. A dict `{{update: k}}` (first key `0`) or an
        `AccumSchedule` makes it a function of applied updates (see
        `accum_optimizers.schedules`). Defaults to `1`, which behaves
        exactly like {parent}.""",
        schedules.get,
        settable=_settable.accum_iters,
        annotation="int | dict[int, int] | AccumSchedule",
    ),
    Argument(
        "skip_nonfinite",
        False,
        """Boolean. Leave a micro-batch whose gradients are not
        all finite (after a `LossScaleOptimizer` unscaled them) out of its
        window: it adds nothing and counts in neither `micro_steps` nor
        the window's weight, and the window closes after `accum_iters`
        finite micro-batches. Under `tf.distribute`, `keras.distribution`
        and `torch_distributed.sync_windows` every replica skips it when
        any replica's gradients are not finite. `skipped_micro_batches`
        counts them. Defaults to `False`.""",
        _bool_check("skip_nonfinite"),
        settable=_settable.skip_nonfinite,
        annotation="bool",
    ),
    Argument(
        "measure_noise_scale",
        False,
        """Boolean. Measure the gradient noise scale of
        McCandlish et al. (2018), `B_simple = tr(Sigma) / |G|^2`, the
        batch beyond which a bigger batch stops paying, from each window's
        micro-batch gradients and their mean (see `noise_scale`). Costs
        one sum of squares per gradient per micro-step (shared with
        `skip_nonfinite`'s check) and nine scalars. Defaults to
        `False`.""",
        _bool_check("measure_noise_scale"),
        settable=_settable.measure_noise_scale,
        annotation="bool",
    ),
    Argument(
        "noise_scale_momentum",
        0.99,
        """Float in `[0, 1)`. The momentum of the moving
        averages of the noise scale's two estimates, over the windows
        that give one: each such window's estimate enters with weight
        `1 - noise_scale_momentum`, and the averages are divided by their
        total weight. Defaults to `0.99`.""",
        _check_noise_scale_momentum,
        settable=_settable.traced("noise_scale_momentum"),
        annotation="float",
    ),
    Argument(
        "accumulator_dtype",
        None,
        """Dtype of the gradient sums: `"float16"`,
        `"bfloat16"`, `"float32"` or `"float64"`. Defaults to `None`:
        `"float32"` for `float16`/`bfloat16` variables, the variable's own
        dtype otherwise. float16 sums refuse weighted windows.""",
        validate_accumulator_dtype,
        settable=_settable.accumulator_dtype,
        annotation="str | None",
    ),
    Argument(
        "jit_compile",
        "auto",
        """Boolean or `"auto"`. On TensorFlow without XLA
        (`model.compile(jit_compile=False)`, Keras' default on a CPU),
        `True` compiles the window's close (the mean of its sums and
        {parent}'s update, once per window) with XLA, as `tf.keras`
        optimizers compiled their update: a few fused loops instead of a
        kernel and a temporary per element-wise operation. Compiling
        costs each traced train step (the first `fit`) about 30 ms per
        variable on 2 CPU cores, whatever its size (196 variables: +5
        s); each window then saves about 2 ns per parameter. `"auto"`
        compiles it where that repays the compile within about 500
        windows: where the variables hold
        at least 131,072 parameters (`2**17`; below that, on a CPU,
        launching the computation costs more than the fusion saves) and
        30,000 per variable on average (not a model of many small
        layers). `False` keeps TensorFlow's ops. A
        close XLA cannot compile (a Python callback in a learning-rate
        schedule, a device without XLA) runs as it is, and so does one
        holding graph checks that XLA compiles as nothing
        (`tf.debugging.check_numerics`, `tf.debugging.Assert` and the
        `tf.debugging.assert_*` of a constraint or a schedule), which then
        raise as under the parent; `True` warns then. No effect where
        the step is compiled already (XLA, JAX) or eager (torch,
        `run_eagerly=True`). Defaults to `"auto"`.""",
        _check_jit_compile,
        settable=_settable.traced("jit_compile"),
        annotation="bool | str",
    ),
    Argument(
        "lr",
        None,
        """Deprecated Keras 2 alias of `learning_rate`; warns. Passing both is
        an error.""",
        _keep,
        in_config=False,
        settable=_settable.lr,
        read=lambda optimizer: optimizer.learning_rate,
        annotation="float | LearningRateSchedule | None",
    ),
    Argument(
        "decay",
        None,
        """Deprecated Keras 2 time decay (`learning_rate /
        (1 + decay * iterations)`, `iterations` counting applied updates);
        warns. Defaults to `None`.""",
        validate_decay,
        settable=_settable.traced("decay"),
        annotation="float | None",
    ),
)

NAMES = tuple(argument.name for argument in ARGUMENTS)


def checked(values):
    """`{name: value}` of every accumulation argument, each checked, from
    the keywords passed (`values`; absent ones take their default)."""
    return {
        argument.name: argument.check(
            values.get(argument.name, argument.default)
        )
        for argument in ARGUMENTS
    }


def config_names():
    """The arguments `get_config` returns."""
    return [argument.name for argument in ARGUMENTS if argument.in_config]


def signature_parameters():
    """The accumulation arguments as keyword-only `inspect.Parameter`s."""
    return [
        inspect.Parameter(
            argument.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=argument.default,
            annotation=argument.annotation,
        )
        for argument in ARGUMENTS
    ]


def docstring(parent):
    """The `Args:` entries of the accumulation arguments, indented by four
    spaces, `parent` naming the parent optimizer."""
    return "\n".join(
        f"    {argument.name}: {argument.doc.format(parent=parent)}"
        for argument in ARGUMENTS
    )


def check_saved(cls, config):
    """Raises a `ValueError` that leads with the reason where an
    accumulation argument in `config` (a saved or edited configuration of
    `cls`) is refused: Keras wraps a `TypeError` raised by `from_config`
    in a generic message that prints the whole config first, and passes a
    `ValueError` on as it is."""
    try:
        checked(config)
    except TypeError as error:
        raise ValueError(
            f"{error}. In the saved configuration of {cls.__name__}."
        ) from None


def config_of(optimizer):
    """The accumulation arguments of `optimizer`'s `get_config`."""
    config = {name: getattr(optimizer, name) for name in config_names()}
    if isinstance(optimizer.accum_iters, schedules.AccumSchedule):
        config["accum_iters"] = keras.saving.serialize_keras_object(
            optimizer.accum_iters
        )
    return config


def loaded_config(cls, config, custom_objects):
    """`config`, a saved configuration of `cls`, with its `accum_iters`
    schedule deserialized and its accumulation arguments checked."""
    accum_iters = config.get("accum_iters")
    if isinstance(accum_iters, dict) and "class_name" in accum_iters:
        config = dict(config)
        config["accum_iters"] = keras.saving.deserialize_keras_object(
            accum_iters, custom_objects=custom_objects
        )
    check_saved(cls, config)
    return config
