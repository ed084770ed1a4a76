"""The window's state, declared once.

An accumulating optimizer's variables are, in order: the parent optimizer's
variables before `build` (`iterations`, and `learning_rate` when it is a
float), those the parent's `build` adds (moments, EMA averages), then, when
the optimizer has a window, the variables of `WINDOW_STATE` (less the noise
scale's, unless it measures it: `window_state`) and one sum per trainable
variable. `build` creates them from this declaration; a window's
close resets those declared `resets`; saving writes every variable as it
is, and restoring (`restore.py`) reads them back by position.
"""


class WindowVariable:
    """One variable of the window's state, before the per-variable sums.

    Args:
        name: the attribute (`_accum_<name>`) and variable (`accum_<name>`)
            name.
        dtype: the variable's dtype.
        per_variable: whether it holds one entry per trainable variable
            (shape `(len(variables),)`) instead of a scalar.
        aggregation: its `tf.distribute` aggregation: `"only_first_replica"`
            for values every replica holds alike, `"mean"` for a value each
            replica accumulates on its own (read outside a replica as their
            mean, the share that goes with one replica's sums).
        saved_by_0_1_0: whether 0.1.0 saved it.
        lasting: whether it outlives the window (a count since creation,
            the last window's metrics), so that it is restored from a
            state saved between windows too.
        resets: whether a window's close sets it back to zero (the next
            window's first micro-step overwrites the others that do not
            last).
        noise_scale: whether only optimizers that measure the gradient
            noise scale (`measure_noise_scale=True`) carry it, so that the
            state (and the saved layout) of every other optimizer is
            unchanged.
    """

    def __init__(
        self,
        name,
        dtype,
        per_variable=False,
        aggregation="only_first_replica",
        saved_by_0_1_0=False,
        lasting=False,
        resets=False,
        noise_scale=False,
    ):
        self.name = name
        self.dtype = dtype
        self.per_variable = per_variable
        self.aggregation = aggregation
        self.saved_by_0_1_0 = saved_by_0_1_0
        self.lasting = lasting
        self.resets = resets
        self.noise_scale = noise_scale

    def shape(self, variable_count):
        return (variable_count,) if self.per_variable else ()


WINDOW_STATE = (
    # Micro-batches in the pending window; 0 between windows.
    WindowVariable("micro_steps", "int32", saved_by_0_1_0=True, resets=True),
    # Micro-batches accumulated since creation.
    WindowVariable("micro_batches", "int32", saved_by_0_1_0=True, lasting=True),
    # Which variables received gradient in the window (`flush` updates
    # those alone).
    WindowVariable("seen", "int32", per_variable=True),
    # The sum of the window's micro-batch weights (1 each without `weight`):
    # the window's mean gradient is its sums divided by this.
    WindowVariable("total_weight", "float32", aggregation="mean", resets=True),
    # Micro-batches left out of their window for non-finite gradients
    # (`skip_nonfinite=True`), since creation.
    WindowVariable("skipped", "int32", lasting=True),
    # The total weight of the applied windows (samples, tokens, or
    # micro-batches of weight 1), as a float32 pair whose sum is exact well
    # past float32's 2**24 (see `_accum_count_samples`).
    WindowVariable("samples_seen", "float32", lasting=True),
    WindowVariable("samples_seen_error", "float32", lasting=True),
    # The window's sum of `weight * loss` (`apply(..., loss=)`, or the loss
    # `fit` computes), summed over replicas like the gradients.
    WindowVariable("loss_sum", "float32", aggregation="sum", resets=True),
    # The last applied window's loss (`loss_sum / total_weight`) and the
    # norm of its mean gradient: the big batch's at the window's weights.
    WindowVariable("window_loss", "float32", lasting=True),
    WindowVariable("window_grad_norm", "float32", lasting=True),
    # The gradient noise scale (`measure_noise_scale=True`, see
    # `_window/noise.py`). Within a window: the sum over its micro-batches
    # of |g_j|^2 (each micro-batch's own mean gradient), of 1 / n_j (their
    # weights) and their count, summed over ranks like the gradients.
    WindowVariable(
        "noise_sq_norm_sum",
        "float32",
        aggregation="sum",
        resets=True,
        noise_scale=True,
    ),
    WindowVariable(
        "noise_inverse_weight_sum",
        "float32",
        aggregation="sum",
        resets=True,
        noise_scale=True,
    ),
    WindowVariable(
        "noise_micro_batches",
        "float32",
        aggregation="sum",
        resets=True,
        noise_scale=True,
    ),
    # The last applied window's unbiased estimates of |G|^2 and tr(Sigma)
    # (NaN for a window of one micro-batch, which gives none).
    WindowVariable(
        "window_gradient_sq_norm", "float32", lasting=True, noise_scale=True
    ),
    WindowVariable(
        "window_noise_trace", "float32", lasting=True, noise_scale=True
    ),
    # Their exponential moving averages over the windows that gave an
    # estimate, and the average's total weight (to debias its start).
    WindowVariable(
        "gradient_sq_norm_average", "float32", lasting=True, noise_scale=True
    ),
    WindowVariable(
        "noise_trace_average", "float32", lasting=True, noise_scale=True
    ),
    WindowVariable(
        "noise_average_weight", "float32", lasting=True, noise_scale=True
    ),
    # The largest noise scale measured so far (`by_noise_scale`'s key when
    # windows only grow).
    WindowVariable(
        "largest_noise_scale", "float32", lasting=True, noise_scale=True
    ),
)


def window_state(measure_noise_scale):
    """The window variables an optimizer carries, in order: all of
    `WINDOW_STATE`, less the noise scale's unless it measures it."""
    return tuple(
        variable
        for variable in WINDOW_STATE
        if measure_noise_scale or not variable.noise_scale
    )


class Layout:
    """How many variables each part of an optimizer's state holds.

    Args:
        unbuilt: variables before `build` (`iterations`, `learning_rate`).
        parent: variables after the parent optimizer's `build`.
        total: all variables, the window's state included.
        state: the window variables it carries (`window_state`), in order.
    """

    def __init__(self, unbuilt, parent, total, state=None):
        self.unbuilt = unbuilt
        self.parent = parent
        self.total = total
        self.state = window_state(False) if state is None else tuple(state)

    @property
    def has_window(self):
        return self.total > self.parent

    @property
    def sums(self):
        """The number of per-variable sums (0 without a window)."""
        if not self.has_window:
            return 0
        return self.total - self.parent - len(self.state)


def resetting_variables(optimizer):
    """The window variables of `optimizer` that a window's close zeroes."""
    return [
        getattr(optimizer, f"_accum_{variable.name}")
        for variable in window_state(optimizer.measure_noise_scale)
        if variable.resets
    ]
