"""What a saved optimizer state means for an accumulating optimizer.

The saved values are indexed by position, in the order the optimizer
created its variables: the parent optimizer's variables before `build`
(`iterations`, and `learning_rate` when it is a float), those `build` adds
(moments, EMA averages), then, with `accum_iters > 1`, the window's state:
the micro-step counter, the micro-batch counter, the mask of variables that
received gradient in the window, the window's extra weight (see
`GradientAccumulation.apply`), and one sum per trainable variable.
"""

import numpy as np

# Variables of the window's state before the per-variable sums.
WINDOW_SCALARS = 4
# Of those, the ones 0.1.0 saved (the two counters).
WINDOW_SCALARS_0_1_0 = 2


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


def plan_restore(values, layout, window_size_at, describe):
    """Checks saved `values` against `layout`; returns what to assign.

    Returns a list of `(index, value)` pairs; the variables it leaves out
    keep their fresh values (an empty window). Raises `ValueError`, naming
    the problem, for a state this optimizer cannot continue exactly:

    - a saved pending window that the window size cannot hold (it holds
      `k - 1` micro-batches at most, `k = window_size_at(iterations)`);
    - counters that no run produces (negative, or more pending micro-batches
      than seen);
    - a variable count that matches none of: this configuration, the same
      configuration saved before training (`unbuilt`), the parent's state
      alone (saved with `accum_iters=1` or by the parent Keras class).

    Args:
        values: the saved arrays, in order.
        layout: the `Layout` of the optimizer being restored.
        window_size_at: maps a number of applied updates to the window size
            (`accum_iters`, or its schedule's value).
        describe: a string naming the optimizer, for error messages.
    """
    count = len(values)
    if count == layout.total:
        parent, window = values[: layout.parent], values[layout.parent :]
    elif (
        layout.has_window
        and count == layout.total - (WINDOW_SCALARS - WINDOW_SCALARS_0_1_0)
        and _is_window_of(values, layout.parent)
        and np.shape(values[layout.parent + 1]) == ()
    ):
        # Saved by 0.1.0, which had no mask of the variables that received
        # gradient (its flush updated every variable) and no weights (every
        # micro-batch counted 1: no extra weight).
        parent, window = values[: layout.parent], values[layout.parent :]
        variables = layout.total - layout.parent - WINDOW_SCALARS
        seen = np.ones(variables, "int32")
        extra_weight = np.zeros((), "float32")
        window = window[:2] + [seen, extra_weight] + window[2:]
    elif count == layout.unbuilt:
        # Saved before the optimizer was built: nothing trained yet.
        parent, window = values, []
    elif count == layout.parent:
        parent, window = values, []
    elif not layout.has_window and _is_window_of(values, layout.parent):
        parent, window = values[: layout.parent], values[layout.parent :]
        pending = int(np.asarray(window[0]))
        if pending:
            raise ValueError(
                f"Cannot restore the state of optimizer {describe}: the "
                f"checkpoint holds a pending window of {pending} "
                "micro-batches, which accum_iters=1 cannot continue. Load it "
                f"with accum_iters > {pending} and call `flush()`, or save "
                "it between windows."
            )
        window = []
    else:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint holds {count} optimizer variables, this optimizer "
            f"has {layout.total}. The checkpoint was saved with a different "
            "optimizer or configuration (amsgrad, momentum, centered, "
            "use_ema, or a learning-rate schedule instead of a float); "
            "rebuild the optimizer with the saved configuration."
        )
    _check_counters(parent, window, window_size_at, describe)
    pairs = list(enumerate(parent))
    if window and layout.has_window:
        pairs += [(layout.parent + i, v) for i, v in enumerate(window)]
    return pairs


def _is_window_of(values, parent_count):
    """Whether `values` is a parent state followed by a window's state."""
    extra = len(values) - parent_count
    return extra > WINDOW_SCALARS_0_1_0 and np.shape(values[parent_count]) == ()


def _check_counters(parent, window, window_size_at, describe):
    iterations = int(np.asarray(parent[0]))
    if iterations < 0:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint's update counter is {iterations}; it must be >= 0."
        )
    if not window:
        return
    pending = int(np.asarray(window[0]))
    seen = int(np.asarray(window[1]))
    accum_iters = window_size_at(iterations)
    if not 0 <= pending <= seen:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint's counters are inconsistent (micro_steps={pending}, "
            f"micro_batches_seen={seen}); it was not written by an "
            "accumulating optimizer."
        )
    if pending >= accum_iters:
        raise ValueError(
            f"Cannot restore the state of optimizer {describe}: the "
            f"checkpoint holds a pending window of {pending} micro-batches, "
            f"more than accum_iters={accum_iters} allows (at most "
            f"{accum_iters - 1}). Load it with accum_iters > {pending}, or "
            "save it between windows."
        )
