"""The accumulation arguments, specified once.

`ARGUMENTS` drives everything that lists them: the checks in
`GradientAccumulation.__init__`, the signature of every accumulating class
(`signature_parameters`), their docstrings (`docstring`) and `get_config`
(`config_names`). An argument added here appears in all four.
"""

import dataclasses
import inspect
import warnings
from typing import Any
from typing import Callable

import keras
import numpy as np

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
    """

    name: str
    default: Any
    doc: str
    check: Callable[[Any], Any]
    in_config: bool = True


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
    ),
    Argument(
        "accumulator_dtype",
        None,
        """Dtype of the gradient sums: `"float16"`,
        `"bfloat16"`, `"float32"` or `"float64"`. Defaults to `None`:
        `"float32"` for `float16`/`bfloat16` variables, the variable's own
        dtype otherwise. float16 sums refuse weighted windows.""",
        validate_accumulator_dtype,
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
        costs each traced train step (the first `fit`) about 65 ms per
        variable on 2 CPU cores, whatever its size (196 variables: +13
        s); each window then saves a few microseconds per variable and
        about 2 ns per parameter. `"auto"` compiles it where that repays
        the compile within about 1,000 windows: where the variables hold
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
    ),
    Argument(
        "lr",
        None,
        """Deprecated Keras 2 alias of `learning_rate`; warns. Passing both is
        an error.""",
        _keep,
        in_config=False,
    ),
    Argument(
        "decay",
        None,
        """Deprecated Keras 2 time decay (`learning_rate /
        (1 + decay * iterations)`, `iterations` counting applied updates);
        warns. Defaults to `None`.""",
        validate_decay,
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


def check_settable_accum_iters(optimizer, accum_iters):
    """Raises where `optimizer` cannot take `accum_iters` (a checked
    value): a window keyed on a noise scale it does not measure, or a
    window on an optimizer built without one."""
    if schedules.keyed_on_noise_scale(accum_iters) and not getattr(
        optimizer, "measure_noise_scale", True
    ):
        raise ValueError(
            "`accum_iters=by_noise_scale(...)` follows the measured "
            "noise scale: pass `measure_noise_scale=True` too. Received: "
            f"accum_iters={accum_iters!r}, measure_noise_scale=False"
        )
    layout = optimizer.__dict__.get("_accum_layout")
    if layout is not None and layout.has_window:
        _check_pending_fits(optimizer, accum_iters)
        return
    if layout is None:
        return
    if not isinstance(accum_iters, int) or accum_iters > 1:
        raise ValueError(
            f"Cannot set `accum_iters` of '{optimizer.name}' to "
            f"{accum_iters!r}: it was built with accum_iters=1, "
            "without the window's state (its sums and counters). "
            "Set `accum_iters` before the optimizer is built (before "
            "the first `fit` or `apply`), or make a new optimizer. "
            f"Received: accum_iters={accum_iters!r}"
        )


def _check_pending_fits(optimizer, accum_iters):
    """Raises where `optimizer` (built, with a window) holds more pending
    micro-batches than a window of `accum_iters` (an int) continues, as a
    load into it would; warns that a compiled train function keeps the
    window size it was traced with."""
    if not isinstance(accum_iters, int):
        return
    try:
        micro_steps = optimizer._window.micro_steps
        pending = int(keras.ops.convert_to_numpy(micro_steps))
    except Exception:  # noqa: BLE001 - traced: nothing to read
        return
    if pending >= accum_iters:
        raise ValueError(
            f"Cannot set `accum_iters` of '{optimizer.name}' to "
            f"{accum_iters}: the optimizer holds a pending window of "
            f"{pending} micro-batches, more than a window of {accum_iters} "
            f"continues (at most {accum_iters - 1}). Call `flush()` first, "
            f"or set a larger value. Received: accum_iters={accum_iters}"
        )
    if accum_iters != optimizer.__dict__.get("_accum_iters"):
        warnings.warn(
            f"`accum_iters` of '{optimizer.name}' set to {accum_iters} "
            "after it was built: a train function already compiled (a "
            "`tf.function`, `jit_compile`, JAX) keeps the window size it "
            "was traced with. Call `model.make_train_function(force=True)` "
            "before the next `fit`.",
            stacklevel=4,
        )


def check_settable_measure_noise_scale(optimizer, measure):
    """Raises where `optimizer` was built without the noise scale's
    variables and `measure` is true."""
    layout = optimizer.__dict__.get("_accum_layout")
    if not measure or layout is None:
        return
    if not any(variable.noise_scale for variable in layout.state):
        raise ValueError(
            f"Cannot set `measure_noise_scale` of '{optimizer.name}' to "
            "True: it was built without the measurement's variables. Pass "
            "`measure_noise_scale=True` when making the optimizer. "
            f"Received: measure_noise_scale={measure!r}"
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
