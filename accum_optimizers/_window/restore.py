"""Saving and restoring the window: what a saved state means (this
version's layout, the parent's state alone, an untrained state, 0.1.0's
window, a window saved without the noise scale's variables or before the
count of refused normalizers), its counters checked, and the optimizer's
`load_own_variables`."""

import itertools
import warnings

import numpy as np
from keras import ops

from accum_optimizers import schedules
from accum_optimizers._validation import concrete_value
from accum_optimizers._window import adascale
from accum_optimizers._window.counts import window_size
from accum_optimizers._window.noise import saved_noise_key
from accum_optimizers._window.spec import window_state

# Of the window's state, 0.1.0 saved its first two counters alone.
_SAVED_BY_0_1_0 = ("micro_steps", "micro_batches")
# Window variables added since, absent from states saved before them (they
# start at 0).
_ADDED_LATER = ("refused",)
# The groups of window variables a saved state may lack: AdaScale's, the
# noise scale's (`measure_noise_scale=False`, or saved before they
# existed), those added since.
_OPTIONAL = (
    lambda variable: variable.adascale,
    lambda variable: variable.noise_scale,
    lambda variable: variable.name in _ADDED_LATER,
)


def pending_restore(optimizer):
    """The saved values `optimizer` keeps for its `build` (a state saved
    after training and loaded before the optimizer was built), or `None`.

    Args:
        optimizer: an accumulating optimizer.
    """
    return optimizer.__dict__.get("_accum_pending_restore")


def load_own_variables(optimizer, store, load_parent_state):
    """`optimizer.load_own_variables(store)`: a saved state is checked
    against the optimizer's layout, then restored, or refused naming why.
    `load_parent_state(store)` is the parent's own, for an untrained
    state."""
    values = [store[str(i)] for i in range(len(store.keys()))]
    values = [np.array(value) for value in values]
    if not values:
        # Nothing of it in the file: Keras' `MultiOptimizer` saves its
        # optimizers' variables as its own and loads none back, warning.
        # Keras' own optimizers skip a state they cannot take, warning.
        warnings.warn(
            f"Skipping variable loading for optimizer '{optimizer.name}': "
            "the file holds no state for it (as for an optimizer inside a "
            "`MultiOptimizer`, whose state Keras does not load back). It "
            "keeps its own state, with an empty window if new.",
            stacklevel=2,
        )
        return
    if not optimizer.built:
        if len(values) == len(optimizer.variables) and not values[0]:
            return load_parent_state(store)  # untrained
        # Saved after training, loaded before `build`: keep the values and
        # check and restore them when the optimizer builds.
        optimizer._accum_pending_restore = tuple(values)
        return
    restore(optimizer, values)


def restore(optimizer, values):
    """Restores saved `values` into the built `optimizer`, or raises."""
    accum_iters = optimizer.accum_iters
    if isinstance(accum_iters, schedules.AccumSchedule):
        accum_iters = type(accum_iters).__name__
    describe = (
        f"'{optimizer.name}' ({type(optimizer).__name__}, "
        f"accum_iters={accum_iters})"
    )
    layout = optimizer._accum_layout
    parent, window = plan_restore(
        values,
        layout,
        lambda parent, window: _saved_window_size(optimizer, parent, window),
        describe,
    )
    empty = is_empty(window)
    restored = list(parent)
    if optimizer._has_window and not empty:
        restored += _in_variable_order(window, layout.state)
    variables = optimizer.variables
    for index, value in enumerate(restored):
        if tuple(np.shape(value)) != tuple(variables[index].shape):
            raise ValueError(
                f"Cannot restore the state of optimizer {describe}: "
                f"saved variable {index} has shape {np.shape(value)}, "
                f"'{variables[index].path}' has shape "
                f"{tuple(variables[index].shape)}."
            )
    for variable, value in zip(variables, restored):
        variable.assign(value)
    if not optimizer._has_window:
        if window is not None:
            _warn_of_counts_lost(parent, window, describe)
        return
    if empty:
        lasting = lasting_values(parent, window, layout.state)
        for spec in layout.state:
            variable = getattr(optimizer._window, spec.name)
            if spec.name == "micro_steps":
                variable.assign(np.zeros((), "int32"))
            elif spec.lasting:
                variable.assign(lasting[spec.name])
    added = sum(v.name in _ADDED_LATER for v in layout.state)
    if optimizer._window.scale_invariant_step is not None and (
        len(values) not in (layout.total, layout.total - added)
    ):
        # Saved without AdaScale or a scaling rule (by the parent, or
        # with another rate).
        adascale.start_at(optimizer._window, parent[0])
    # The saved run's refused micro-batches were its `fit`'s to report.
    refused = concrete_value(optimizer._window.refused.value)
    optimizer._refused_reported = int(refused or 0)


def _saved_window_size(optimizer, parent, window):
    """The window size the next update of a planned saved state takes (see
    `plan_restore`)."""
    schedule = optimizer._accum_schedule
    if schedule is None:
        return optimizer.accum_iters
    state = optimizer._accum_layout.state
    if schedules.keyed_on_noise_scale(schedule):
        values = lasting_values(parent, window, state)
        key = saved_noise_key(values, schedule, optimizer.noise_scale_momentum)
    elif schedules.keyed_on_samples(schedule):
        key = np.float32(saved_samples_seen(parent, window, state))
    else:
        key = int(np.asarray(parent[0]))
    return int(ops.convert_to_numpy(window_size(optimizer, key)))


def plan_restore(values, layout, window_size_at, describe):
    """Checks saved `values` against `layout`.

    Returns `(parent, window)`: the parent optimizer's values, and the
    window's values in the order of `layout.state` followed by the sums, or
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
      with `iterations` 0), a window saved by 0.1.0, a window saved
      without the noise scale's variables (by `measure_noise_scale=False`,
      or before they existed) when this optimizer measures it, or without
      AdaScale's (and a float learning rate) when its rate is AdaScale's,
      or before the variables added since (`_ADDED_LATER`), or several.

    Args:
        values: the saved arrays, in order.
        layout: the `Layout` of the optimizer being restored.
        window_size_at: maps `(parent, window)`, a planned state, to the
            window size its next update takes (`accum_iters`, or its
            schedule's value at the saved updates or samples seen).
        describe: a string naming the optimizer, for error messages.
    """
    parent, window = _split(values, layout, describe)
    _check_counters(parent, window, layout, window_size_at, describe)
    return parent, window


def _split(values, layout, describe):
    """`(parent, window)` of saved `values` laid out as one of the states
    `plan_restore` accepts, or raises."""
    split = _split_as_saved(values, layout, describe)
    if split is None and _saved_learning_rate(values, layout):
        # A float rate, saved beside `iterations`: AdaScale's replaces it.
        split = _split_as_saved([values[0], *values[2:]], layout, describe)
    if split is not None:
        return split
    adascale = ""
    if any(variable.adascale for variable in layout.state):
        adascale = (
            " With a learning rate that follows the window (AdaScale's or "
            "a scaling rule's) it also takes the state of the same "
            "optimizer and configuration saved without it (`learning_rate` "
            "a float or a schedule), or the parent's."
        )
    raise ValueError(
        f"Cannot restore the state of optimizer {describe}: the "
        f"checkpoint holds {len(values)} optimizer variables, this "
        f"optimizer has {layout.total}. The checkpoint was saved with a "
        "different optimizer or configuration (amsgrad, momentum, "
        "centered, use_ema, measure_noise_scale, an AdaScale learning "
        "rate or a scaling rule's, or a learning-rate schedule instead of "
        "a float); rebuild the optimizer with the saved configuration."
        f"{adascale}"
    )


def _split_as_saved(values, layout, describe):
    """`_split`, or `None` where `values` match no accepted layout."""
    count = len(values)
    if count == layout.parent:
        return values, None
    state = layout.state
    if count == layout.total:
        window = _in_state_order(values[layout.parent :], state)
        return values[: layout.parent], window
    if (
        layout.has_window
        and count == layout.total - _absent_from_0_1_0(state)
        and _is_window_of(values, layout.parent, state)
        and np.shape(values[layout.parent + 1]) == ()
    ):
        window = _window_of_0_1_0(values[layout.parent :], layout.sums, state)
        return values[: layout.parent], window
    for absent in _older_layouts(state) if layout.has_window else ():
        missing = sum(1 for variable in state if absent(variable))
        if count != layout.total - missing:
            continue
        window = _window_without(values[layout.parent :], state, absent)
        # A count can match by chance (a schedule saved one variable less
        # than a float learning rate): the window's shapes tell.
        if _is_laid_out(window, state, layout.sums):
            return values[: layout.parent], window
    if count == layout.unbuilt:
        if int(np.asarray(values[0])) != 0:
            raise ValueError(
                f"Cannot restore the state of optimizer {describe}: the "
                f"checkpoint holds {count} optimizer variables with "
                f"iterations={int(np.asarray(values[0]))}, the trained state "
                "of an optimizer without the moments this one keeps "
                f"({layout.parent} variables once built). It was saved by "
                "another optimizer or configuration; rebuild the optimizer "
                "with the saved configuration."
            )
        return values, None
    if not layout.has_window and _is_window_of(values, layout.parent, state):
        return values[: layout.parent], values[layout.parent :]
    return None


def _saved_learning_rate(values, layout):
    """Whether `values` may hold a float learning rate after `iterations`,
    which an optimizer with an AdaScale learning rate (a schedule) lacks."""
    return (
        any(variable.adascale for variable in layout.state)
        and len(values) > 1
        and np.shape(values[1]) == ()
        and np.asarray(values[1]).dtype.kind == "f"
    )


def is_empty(window):
    """Whether a planned `window` holds no pending micro-batch. Between
    windows the sums may hold the last window's values, which the next
    micro-step overwrites: they are not restored."""
    return window is None or int(np.asarray(window[0])) == 0


def lasting_values(parent, window, state):
    """`{name: value}` of the `lasting` window variables (of `state`, the
    layout's) a restored state holds: the saved values, or for a state
    saved without a window (by `accum_iters=1` or the parent class) one
    micro-batch of weight 1 per update, as `accum_iters=1` counts, and
    zeros."""
    if window is not None:
        return {
            variable.name: np.asarray(value)
            for variable, value in zip(state, window)
            if variable.lasting
        }
    updates = np.asarray(parent[0])
    values = {}
    for variable in state:
        if variable.name in ("micro_batches", "samples_seen"):
            values[variable.name] = updates.astype(variable.dtype)
        elif variable.lasting:
            values[variable.name] = np.zeros((), variable.dtype)
    return values


def saved_samples_seen(parent, window, state):
    """The samples seen a planned state holds (see `lasting_values`)."""
    values = lasting_values(parent, window, state)
    return float(values["samples_seen"]) + float(values["samples_seen_error"])


def _absent_from_0_1_0(state):
    return sum(v.name not in _SAVED_BY_0_1_0 for v in state)


def _older_layouts(state):
    """Predicates picking the variables of `state` each older layout
    lacks: every combination of the `_OPTIONAL` groups `state` holds."""
    groups = [g for g in _OPTIONAL if any(g(v) for v in state)]
    return [
        lambda variable, combination=combination: any(
            group(variable) for group in combination
        )
        for size in range(1, len(groups) + 1)
        for combination in itertools.combinations(groups, size)
    ]


def _in_state_order(window, state):
    """A window's saved values, in its variable order (the variables of
    `state` made before the sums, the sums, those made after them), in
    `state`'s order followed by the sums (the order this module reads)."""
    after = sum(variable.after_sums for variable in state)
    before = len(state) - after
    sums_end = len(window) - after
    return (
        list(window[:before])
        + list(window[sums_end:])
        + list(window[before:sums_end])
    )


def _in_variable_order(window, state):
    """The inverse of `_in_state_order`."""
    after = sum(variable.after_sums for variable in state)
    before = len(state) - after
    return (
        list(window[:before])
        + list(window[len(state) :])
        + list(window[before : len(state)])
    )


def _is_laid_out(window, state, sums):
    """Whether `window`'s values before the sums have the shapes of
    `state`'s variables (`sums` of them per variable)."""
    return all(
        np.shape(value) == variable.shape(sums)
        for variable, value in zip(state, window)
    )


def _window_without(window, state, absent):
    """A window saved without the variables of `state` that `absent`
    picks (the noise scale's: this layout before they existed, or
    `measure_noise_scale=False`; AdaScale's; those added since), in its
    variable order, in `state`'s layout: nothing measured yet, counts
    added since at 0. A pending window's first micro-batches were not
    measured where the noise scale's are absent: its count is NaN, so that
    it gives no estimate."""
    pending = int(np.asarray(window[0])) > 0
    saved_state = [variable for variable in state if not absent(variable)]
    saved = iter(_in_state_order(window, saved_state))
    upgraded = []
    for variable in state:
        if not absent(variable):
            upgraded.append(next(saved))
        elif variable.name == "noise_micro_batches" and pending:
            upgraded.append(np.asarray(np.nan, variable.dtype))
        else:
            upgraded.append(np.zeros((), variable.dtype))
    return upgraded + list(saved)


def _window_of_0_1_0(window, sums, state):
    """0.1.0's window (the two counters, then the sums) in today's layout:
    every variable counts as seen (its flush updated every variable) and
    every micro-batch weighed 1."""
    saved = iter(window)
    upgraded = []
    for variable in state:
        if variable.name in _SAVED_BY_0_1_0:
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


def _is_window_of(values, parent_count, state):
    """Whether `values` is a parent state followed by a window's state."""
    counters = len(state) - _absent_from_0_1_0(state)
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


def _warn_of_counts_lost(parent, window, describe):
    """Warns where a saved window's counts since creation differ from what
    an optimizer without a window reports (one micro-batch of weight 1 per
    update, none skipped): it keeps no variable to restore them into."""
    # The counts before the variables added since: saved by every layout.
    saved = {
        variable.name: float(np.asarray(value))
        for variable, value in zip(window_state(False), window)
        if variable.name
        in ("micro_batches", "skipped", "samples_seen", "samples_seen_error")
    }
    updates = float(np.asarray(parent[0]))
    samples = saved["samples_seen"] + saved["samples_seen_error"]
    if (saved["micro_batches"], samples, saved["skipped"]) == (updates,) * 2 + (
        0.0,
    ):
        return
    warnings.warn(
        f"Optimizer {describe} keeps no window, so it restarts its counts "
        "from its update count: the checkpoint's micro_batches_seen="
        f"{saved['micro_batches']:g}, samples_seen={samples:g} and "
        f"skipped_micro_batches={saved['skipped']:g} now read "
        f"{updates:g}, {updates:g} and 0. Load it with accum_iters > 1 to "
        "keep them.",
        stacklevel=4,
    )
