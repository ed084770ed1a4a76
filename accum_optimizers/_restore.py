"""The window's state, declared once, and what a saved state means.

An accumulating optimizer's variables are, in order: the parent optimizer's
variables before `build` (`iterations`, and `learning_rate` when it is a
float), those the parent's `build` adds (moments, EMA averages), then, with
`accum_iters > 1`, the variables of `WINDOW_STATE` and one sum per
trainable variable. `build` creates them from this declaration; saving
writes every variable as it is; restoring (`plan_restore`) reads them back
by position.
"""

import numpy as np


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
    """

    def __init__(
        self,
        name,
        dtype,
        per_variable=False,
        aggregation="only_first_replica",
        saved_by_0_1_0=False,
        lasting=False,
    ):
        self.name = name
        self.dtype = dtype
        self.per_variable = per_variable
        self.aggregation = aggregation
        self.saved_by_0_1_0 = saved_by_0_1_0
        self.lasting = lasting

    def shape(self, variable_count):
        return (variable_count,) if self.per_variable else ()


WINDOW_STATE = (
    # Micro-batches in the pending window; 0 between windows.
    WindowVariable("micro_steps", "int32", saved_by_0_1_0=True),
    # Micro-batches accumulated since creation.
    WindowVariable("micro_batches", "int32", saved_by_0_1_0=True, lasting=True),
    # Which variables received gradient in the window (`flush` updates
    # those alone).
    WindowVariable("seen", "int32", per_variable=True),
    # The sum of the window's micro-batch weights (1 each without `weight`):
    # the window's mean gradient is its sums divided by this.
    WindowVariable("total_weight", "float32", aggregation="mean"),
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
    WindowVariable("loss_sum", "float32", aggregation="sum"),
    # The last applied window's loss (`loss_sum / total_weight`) and the
    # norm of its mean gradient: the big batch's at the window's weights.
    WindowVariable("window_loss", "float32", lasting=True),
    WindowVariable("window_grad_norm", "float32", lasting=True),
)


class Layout:
    """How many variables each part of an optimizer's state holds.

    Args:
        unbuilt: variables before `build` (`iterations`, `learning_rate`).
        parent: variables after the parent optimizer's `build`.
        total: all variables, the window's state included.
    """

    def __init__(self, unbuilt, parent, total):
        self.unbuilt = unbuilt
        self.parent = parent
        self.total = total

    @property
    def has_window(self):
        return self.total > self.parent

    @property
    def sums(self):
        """The number of per-variable sums (0 without a window)."""
        if not self.has_window:
            return 0
        return self.total - self.parent - len(WINDOW_STATE)


def plan_restore(values, layout, window_size_at, describe):
    """Checks saved `values` against `layout`.

    Returns `(parent, window)`: the parent optimizer's values, and the
    window's values in the order of `WINDOW_STATE` followed by the sums, or
    `None` when the state has none (see `is_empty`).
    Raises `ValueError`, naming the problem, for a state this optimizer
    cannot continue exactly:

    - a saved pending window that the window size cannot hold (it holds
      `k - 1` micro-batches at most, `k = window_size_at(parent, window)`);
    - counters that no run produces (negative, or more pending micro-batches
      than seen);
    - a variable count that matches none of: this configuration, the parent's
      state alone (saved with `accum_iters=1` or by the parent Keras class),
      the same configuration saved before training (`unbuilt` variables,
      with `iterations` 0), a window saved by 0.1.0.

    Args:
        values: the saved arrays, in order.
        layout: the `Layout` of the optimizer being restored.
        window_size_at: maps `(parent, window)`, a planned state, to the
            window size its next update takes (`accum_iters`, or its
            schedule's value at the saved updates or samples seen).
        describe: a string naming the optimizer, for error messages.
    """
    count = len(values)
    window = None
    if count == layout.parent:
        parent = values
    elif count == layout.total:
        parent, window = values[: layout.parent], values[layout.parent :]
    elif (
        layout.has_window
        and count == layout.total - _absent_from_0_1_0()
        and _is_window_of(values, layout.parent)
        and np.shape(values[layout.parent + 1]) == ()
    ):
        parent = values[: layout.parent]
        window = _window_of_0_1_0(values[layout.parent :], layout.sums)
    elif count == layout.unbuilt:
        parent = values
        if int(np.asarray(parent[0])) != 0:
            raise ValueError(
                f"Cannot restore the state of optimizer {describe}: the "
                f"checkpoint holds {count} optimizer variables with "
                f"iterations={int(np.asarray(parent[0]))}, the trained state "
                "of an optimizer without the moments this one keeps "
                f"({layout.parent} variables once built). It was saved by "
                "another optimizer or configuration; rebuild the optimizer "
                "with the saved configuration."
            )
    elif not layout.has_window and _is_window_of(values, layout.parent):
        parent, window = values[: layout.parent], values[layout.parent :]
    else:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint holds {count} optimizer variables, this optimizer "
            f"has {layout.total}. The checkpoint was saved with a different "
            "optimizer or configuration (amsgrad, momentum, centered, "
            "use_ema, or a learning-rate schedule instead of a float); "
            "rebuild the optimizer with the saved configuration."
        )
    _check_counters(parent, window, layout, window_size_at, describe)
    return parent, window


def is_empty(window):
    """Whether a planned `window` holds no pending micro-batch. Between
    windows the sums may hold the last window's values, which the next
    micro-step overwrites: they are not restored."""
    return window is None or int(np.asarray(window[0])) == 0


def lasting_values(parent, window):
    """`{name: value}` of the `lasting` window variables a restored state
    holds: the saved values, or for a state saved without a window (by
    `accum_iters=1` or the parent class) one micro-batch of weight 1 per
    update, as `accum_iters=1` counts, and zeros."""
    if window is not None:
        return {
            variable.name: np.asarray(value)
            for variable, value in zip(WINDOW_STATE, window)
            if variable.lasting
        }
    updates = np.asarray(parent[0])
    values = {}
    for variable in WINDOW_STATE:
        if variable.name in ("micro_batches", "samples_seen"):
            values[variable.name] = updates.astype(variable.dtype)
        elif variable.lasting:
            values[variable.name] = np.zeros((), variable.dtype)
    return values


def saved_samples_seen(parent, window):
    """The samples seen a planned state holds (see `lasting_values`)."""
    values = lasting_values(parent, window)
    return float(values["samples_seen"]) + float(values["samples_seen_error"])


def _absent_from_0_1_0():
    return sum(not v.saved_by_0_1_0 for v in WINDOW_STATE)


def _window_of_0_1_0(window, sums):
    """0.1.0's window (the two counters, then the sums) in today's layout:
    every variable counts as seen (its flush updated every variable) and
    every micro-batch weighed 1."""
    saved = iter(window)
    upgraded = []
    for variable in WINDOW_STATE:
        if variable.saved_by_0_1_0:
            upgraded.append(next(saved))
        elif variable.name == "seen":
            upgraded.append(np.ones(sums, "int32"))
        elif variable.name == "total_weight":
            upgraded.append(np.asarray(window[0], "float32"))
        elif variable.name == "samples_seen":
            # Every applied micro-batch weighed 1.
            applied = int(np.asarray(window[1])) - int(np.asarray(window[0]))
            upgraded.append(np.asarray(applied, "float32"))
        else:  # counts and metrics 0.1.0 did not keep
            upgraded.append(np.zeros((), variable.dtype))
    return upgraded + list(saved)


def _is_window_of(values, parent_count):
    """Whether `values` is a parent state followed by a window's state."""
    counters = len(WINDOW_STATE) - _absent_from_0_1_0()
    extra = len(values) - parent_count
    return extra > counters and np.shape(values[parent_count]) == ()


def _check_counters(parent, window, layout, window_size_at, describe):
    iterations = int(np.asarray(parent[0]))
    if iterations < 0:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint's update counter is {iterations}; it must be >= 0."
        )
    if window is None:
        return
    pending = int(np.asarray(window[0]))
    seen = int(np.asarray(window[1]))
    if not 0 <= pending <= seen:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint's counters are inconsistent (micro_steps={pending}, "
            f"micro_batches_seen={seen}); it was not written by an "
            "accumulating optimizer."
        )
    if pending and not layout.has_window:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint holds a pending window of {pending} "
            "micro-batches, which accum_iters=1 cannot continue. Load it "
            f"with accum_iters > {pending} and call `flush()`, or save "
            "it between windows."
        )
    accum_iters = window_size_at(parent, window)
    if pending >= accum_iters:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint holds a pending window of {pending} micro-batches, "
            f"more than accum_iters={accum_iters} allows (at most "
            f"{accum_iters - 1}). Load it with accum_iters > {pending}, or "
            "save it between windows."
        )
