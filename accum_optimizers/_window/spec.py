"""The window's state, declared once, and the record that holds it.

An accumulating optimizer's variables are, in order: the parent optimizer's
variables before `build` (`iterations`, and `learning_rate` when it is a
float), those the parent's `build` adds (moments, EMA averages), then, when
the optimizer has a window, the variables of `WINDOW_STATE` (less the noise
scale's, unless it measures it: `window_state`), one sum per trainable
variable, then the window variables made `after_sums`. `build` creates
them from this declaration into a `Window`; saving writes every variable
as it is, and restoring (`restore.py`) reads them back by position.
"""

import dataclasses

import keras
from keras import backend
from keras import ops

from accum_optimizers import _backend
from accum_optimizers import _keras_private
from accum_optimizers._validation import LOW_PRECISION_DTYPES


@dataclasses.dataclass(frozen=True)
class WindowVariable:
    """One variable of the window's state, before the per-variable sums.

    Args:
        name: the `Window` field and the variable's name (`accum_<name>`).
        dtype: the variable's dtype.
        per_variable: whether it holds one entry per trainable variable
            (shape `(len(variables),)`) instead of a scalar.
        aggregation: its `tf.distribute` aggregation: `"only_first_replica"`
            for values every replica holds alike, `"mean"` or `"sum"` for a
            value each replica accumulates on its own.
        lasting: whether it outlives the window (a count since creation,
            the last window's metrics); the others are the pending
            window's, overwritten by the next window's first micro-step.
        noise_scale: whether only optimizers that measure the gradient
            noise scale carry it, so that every other optimizer's state
            (and saved layout) is unchanged.
        adascale: whether only optimizers whose learning rate follows
            the window carry it: AdaScale's (`schedules.adascale`) or a
            scaling rule's (`linear_scaling`, `sqrt_scaling`).
        after_sums: whether it is made after the sums (declared last): a
            variable added since states were saved, so that every older
            variable keeps its position (TensorFlow checkpoints match an
            optimizer's variables by their index).
    """

    name: str
    dtype: str
    per_variable: bool = False
    aggregation: str = "only_first_replica"
    lasting: bool = False
    noise_scale: bool = False
    adascale: bool = False
    after_sums: bool = False

    def shape(self, variable_count):
        return (variable_count,) if self.per_variable else ()


_V = WindowVariable
WINDOW_STATE = (
    # Micro-batches in the pending window; 0 between windows.
    _V("micro_steps", "int32"),
    # Micro-batches accumulated since creation.
    _V("micro_batches", "int32", lasting=True),
    # Which variables received gradient in the window.
    _V("seen", "int32", per_variable=True),
    # The sum of the window's micro-batch weights (1 each without one).
    _V("total_weight", "float32", aggregation="mean"),
    # Micro-batches left out of their window, since creation.
    _V("skipped", "int32", lasting=True),
    # The applied windows' total weight, as a float32 pair whose sum stays
    # exact past float32's 2**24 (`close.count_samples`).
    _V("samples_seen", "float32", lasting=True),
    _V("samples_seen_error", "float32", lasting=True),
    # The window's sum of `weight * loss`.
    _V("loss_sum", "float32", aggregation="sum"),
    # The last applied window's loss and mean gradient's norm.
    _V("window_loss", "float32", lasting=True),
    _V("window_grad_norm", "float32", lasting=True),
    # The gradient noise scale (`noise.py`): within a window, the sums of
    # the micro-batches' |g_j|^2, of 1 / n_j and their count.
    _V("noise_sq_norm_sum", "float32", aggregation="sum", noise_scale=True),
    _V(
        "noise_inverse_weight_sum",
        "float32",
        aggregation="sum",
        noise_scale=True,
    ),
    _V("noise_micro_batches", "float32", aggregation="sum", noise_scale=True),
    # The last window's estimates of |G|^2 and tr(Sigma), their moving
    # averages and the averages' total weight, the largest noise scale.
    _V("window_gradient_sq_norm", "float32", lasting=True, noise_scale=True),
    _V("window_noise_trace", "float32", lasting=True, noise_scale=True),
    _V("gradient_sq_norm_average", "float32", lasting=True, noise_scale=True),
    _V("noise_trace_average", "float32", lasting=True, noise_scale=True),
    _V("noise_average_weight", "float32", lasting=True, noise_scale=True),
    _V("largest_noise_scale", "float32", lasting=True, noise_scale=True),
    # A learning rate that follows the window (`adascale.py`): the base
    # steps the last update stood for (AdaScale's gain, or a scaling
    # rule's `S`), and the scale-invariant step as a compensated pair.
    _V("adascale_gain", "float32", lasting=True, adascale=True),
    _V("scale_invariant_step", "float32", lasting=True, adascale=True),
    _V("scale_invariant_step_error", "float32", lasting=True, adascale=True),
    # Micro-batches left out of their window since creation because
    # compiled code refused their loss normalizer (`weigh_micro_batches`);
    # the end of `fit` raises for them. States saved before it lack it.
    _V("refused", "int32", lasting=True, after_sums=True),
)
del _V


def window_state(measure_noise_scale, adascale=False):
    """The window variables an optimizer carries, in order: all of
    `WINDOW_STATE`, less the noise scale's unless it measures it and
    those of `adascale` unless its learning rate follows the window."""
    return tuple(
        variable
        for variable in WINDOW_STATE
        if (measure_noise_scale or not variable.noise_scale)
        and (adascale or not variable.adascale)
    )


@dataclasses.dataclass
class Window:
    """The variables of one optimizer's window (see `WINDOW_STATE`); the
    noise scale's are `None` where it is not measured."""

    micro_steps: object
    micro_batches: object
    seen: object
    total_weight: object
    skipped: object
    samples_seen: object
    samples_seen_error: object
    loss_sum: object
    window_loss: object
    window_grad_norm: object
    sums: list
    refused: object = None
    noise_sq_norm_sum: object = None
    noise_inverse_weight_sum: object = None
    noise_micro_batches: object = None
    window_gradient_sq_norm: object = None
    window_noise_trace: object = None
    gradient_sq_norm_average: object = None
    noise_trace_average: object = None
    noise_average_weight: object = None
    largest_noise_scale: object = None
    adascale_gain: object = None
    scale_invariant_step: object = None
    scale_invariant_step_error: object = None
    # Whether the close is applying the parent's update (a Python fact,
    # while the close runs or is traced): AdaScale's rate then takes the
    # window's gain as it is (`adascale.applying`).
    closing: bool = False

    @property
    def measures_noise(self):
        return self.noise_sq_norm_sum is not None

    def samples(self):
        """`samples_seen`, from its compensated pair."""
        return ops.add(self.samples_seen.value, self.samples_seen_error.value)


def build_window(optimizer, variables, state):
    """A `Window` of new variables of `optimizer`: one per `WindowVariable`
    of `state`, in order, then one sum per variable of `variables`, then
    those of `state` made `after_sums`."""

    def make(spec):
        return _replica_local(
            optimizer,
            f"accum_{spec.name}",
            spec.shape(len(variables)),
            spec.dtype,
            aggregation=spec.aggregation,
        )

    made = {spec.name: make(spec) for spec in state if not spec.after_sums}
    sums = [_sum_of(optimizer, variable) for variable in variables]
    made.update({spec.name: make(spec) for spec in state if spec.after_sums})
    return Window(sums=sums, **made)


def _sum_of(optimizer, variable):
    """The sum of `variable`'s gradients: float32 for a low-precision
    variable unless `accumulator_dtype` says otherwise."""
    dtype = optimizer.accumulator_dtype
    if dtype is None:
        dtype = backend.standardize_dtype(variable.dtype)
        if dtype in LOW_PRECISION_DTYPES:
            dtype = "float32"
    return _replica_local(
        optimizer,
        f"{variable.path.replace('/', '_')}_accum_sum",
        variable.shape,
        dtype,
        reference=variable,
    )


def _replica_local(
    optimizer, name, shape, dtype, reference=None, aggregation="sum"
):
    """A variable of `optimizer` each `tf.distribute` replica holds its
    own copy of (`synchronization="on_read"`): replicas add their own
    gradients without communication, and the close sums the copies once.
    Read outside a replica (saving), a sum is the total over replicas;
    assigned outside, it is split evenly. Elsewhere a plain variable, laid
    out like `reference`."""
    with _backend.colocate(optimizer, reference):
        with keras.name_scope(optimizer.name, caller=optimizer):
            variable = keras.Variable(
                initializer=keras.initializers.Zeros(),
                shape=shape,
                dtype=dtype,
                trainable=False,
                aggregation=aggregation,
                synchronization="on_read",
                layout=_keras_private.variable_layout(reference),
                name=name,
            )
    _keras_private.track_variable(optimizer, variable)
    return variable


@dataclasses.dataclass(frozen=True)
class Layout:
    """How many variables each part of an optimizer's state holds.

    Args:
        unbuilt: variables before `build` (`iterations`, `learning_rate`).
        parent: variables after the parent optimizer's `build`.
        total: all variables, the window's state included.
        state: the window variables it carries (`window_state`), in order.
    """

    unbuilt: int
    parent: int
    total: int
    state: tuple = window_state(False)

    @property
    def has_window(self):
        return self.total > self.parent

    @property
    def sums(self):
        """The number of per-variable sums (0 without a window)."""
        if not self.has_window:
            return 0
        return self.total - self.parent - len(self.state)
