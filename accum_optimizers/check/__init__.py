"""`check_exactness`: is my accumulated run the big batch?

Trains clones of your model three ways from the same weights on the same
samples in the same order: the accumulating optimizer at `batch_size=b`,
its parent Keras optimizer at `k * b`, and that parent again with the
samples of each big batch reordered, whose distance from the big batch is
the float round-off floor of your model. Drift within that floor is
exact. It also names every known cause of non-equivalence it finds in the
model, the data and the callbacks, with its remedy. `python -m
accum_optimizers.check model.keras data.npz --batch-size 8` runs it on a
saved model.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Sequence

import keras
import numpy as np

from accum_optimizers import _keras_private
from accum_optimizers import schedules
from accum_optimizers._accumulation import GradientAccumulation
from accum_optimizers._adascale_schedule import follows_window
from accum_optimizers.check import _data
from accum_optimizers.check import _runs
from accum_optimizers.check._diagnosis import Setup
from accum_optimizers.check._diagnosis import diagnose
from accum_optimizers.check._report import Cause
from accum_optimizers.check._report import ExactnessReport
from accum_optimizers.check._report import VariableDrift
from accum_optimizers.check._report import per_update
from accum_optimizers.check._report import variable_drifts

__all__ = ["Cause", "ExactnessReport", "VariableDrift", "check_exactness"]


def check_exactness(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    batch_size: int,
    sample_weight: Any = None,
    updates: int = 20,
    optimizer: keras.optimizers.Optimizer | None = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    seed: int = 0,
    verbose: int = 1,
) -> ExactnessReport:
    """Checks that `model`'s accumulating optimizer trains it as its parent
    would on the `accum_iters` times bigger batch.

    Clones `model` with its weights and compiles each clone with its loss
    and a new optimizer made from the optimizer's configuration, then
    trains, from the same weights on the first `updates * k * b` samples in
    order: the accumulating optimizer at `batch_size=b`, its parent Keras
    optimizer at `k * b`, and the parent at `k * b` with each big batch's
    samples reordered. The last run's distance from the big batch is the
    round-off floor (Adam turns float round-off into visible drift after a
    few dozen updates on some models); a drift within
    `FLOOR_MULTIPLE` (10) times the floor, plus a few float32 ulps, reads
    as exact. Random layers (`Dropout`, `GaussianNoise`, ...) of a
    Sequential or Functional model are called with `training=False` in all
    three runs, as they draw other numbers per micro-batch by design.

    `model`, its optimizer's state and the global random states (Python's,
    numpy's, Keras' and torch's) are left as they were.

    Args:
        model: a built, compiled `keras.Model` (Sequential, Functional, or a
            class of your own that `keras.models.clone_model` can clone).
        x: the training inputs: an array, or a list or dict of arrays.
        y: the targets, likewise.
        batch_size: Integer >= 1. The micro-batch size `b` you train with.
        sample_weight: optional per-sample weights.
        updates: Integer >= 1. The number of windows to compare.
            Defaults to `20`.
        optimizer: the accumulating optimizer to check (possibly in a
            `LossScaleOptimizer`); defaults to `model.optimizer`. It is not
            used, only its configuration.
        callbacks: the callbacks you pass to `fit`, to diagnose with
            (`FlushAccumulation`, `AccumulationLogger`); they are not run.
        seed: Integer. Seeds the reordering of the big batches.
        verbose: `0` prints nothing; `1` (the default) prints the report.

    Returns:
        An `ExactnessReport`: `exact`, the per-update `drift` and `floor`,
        the per-variable `table`, and the `causes` found, each with its
        remedy.

    Raises:
        ValueError: an argument that cannot be checked (an optimizer that
            does not accumulate, `updates < 1`, too few samples), named
            with its value.
    """
    optimizer, k, samples = check_arguments(
        model,
        x,
        y,
        batch_size=batch_size,
        sample_weight=sample_weight,
        updates=updates,
        optimizer=optimizer,
    )
    callbacks = list(callbacks or [])
    used = np.arange(updates * k * batch_size)
    reordered = _runs.reordered_within(k * batch_size, len(used), seed)
    data = tuple(_runs.take(d, used) for d in (x, y, sample_weight))
    shuffled = tuple(_runs.take(d, reordered) for d in (x, y, sample_weight))
    with _runs.global_random_state_kept():
        result = _compare(model, optimizer, k, batch_size, data, shuffled)
    setup = Setup(
        model=model,
        optimizer=optimizer,
        accum_iters=k,
        batch_size=batch_size,
        samples=samples,
        callbacks=callbacks,
        **result.facts,
    )
    report = ExactnessReport(
        exact=all(v.exact for v in result.table),
        optimizer=f"{type(_inner(optimizer)).__name__}(accum_iters={k})",
        batch_size=batch_size,
        accum_iters=k,
        updates=updates,
        drift=result.drift,
        floor=result.floor,
        table=result.table,
        causes=diagnose(setup),
        notes=result.notes,
    )
    if verbose:
        print(report)
    return report


def check_arguments(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    batch_size: int,
    sample_weight: Any = None,
    updates: int = 20,
    optimizer: keras.optimizers.Optimizer | None = None,
) -> tuple[keras.optimizers.Optimizer, int, int]:
    """Checks the arguments of `check_exactness` without training anything
    (its command line tells a usage error from a drift with it).

    Args:
        model, x, y, batch_size, sample_weight, updates, optimizer: as
            `check_exactness` takes them.

    Returns:
        `(optimizer, accum_iters, samples)`: the accumulating optimizer to
        check, its window size and the number of samples in `x`.

    Raises:
        ValueError: an argument that cannot be checked, named with its
            value.
    """
    optimizer = model_optimizer(model, optimizer)
    k = int(_inner(optimizer).accum_iters)
    _data.check_positive_int("batch_size", batch_size)
    _data.check_positive_int("updates", updates)
    samples = _data.sample_count(x, y, sample_weight)
    _data.check_input_shapes(model, x)
    needed = updates * k * batch_size
    if samples < needed:
        raise ValueError(
            f"`updates={updates}` windows of accum_iters={k} micro-batches "
            f"of batch_size={batch_size} need {needed} samples; x has "
            f"{samples}. Pass fewer `updates` or more data. Received: "
            f"updates={updates}, len(x)={samples}"
        )
    return optimizer, k, samples


@dataclasses.dataclass
class _Comparison:
    """What `_compare` measured: `table`, `drift`, `floor`, `notes`, and
    the `facts` the diagnosis reads (see `Setup`)."""

    table: list
    drift: list
    floor: list
    notes: list
    facts: dict


def _trained(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    accumulates: bool,
    k: int,
    batch_size: int,
    samples: tuple[Any, Any, Any],
) -> tuple[keras.Model, bool, list[list[np.ndarray]]]:
    """`(clone, swapped, snapshots)`: a clone of `model` (see
    `_runs.clone_model` for `swapped`) trained on `samples` by the
    accumulating optimizer at `batch_size` (`accumulates`) or by its
    parent at `k * batch_size`, and its weights after every update."""
    clone, swapped = _runs.clone_model(
        model,
        batch_norm_accum_iters=None if accumulates else 1,
        random_layers_off=True,
    )
    accumulating, parent = _runs.fresh_optimizers(optimizer)
    _runs.compile_like(clone, model, accumulating if accumulates else parent)
    snapshots = _runs.train(
        clone,
        samples,
        batch_size if accumulates else k * batch_size,
        snapshot_every=k if accumulates else 1,
    )
    return clone, swapped, snapshots


def _compare(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    k: int,
    batch_size: int,
    data: tuple[Any, Any, Any],
    shuffled: tuple[Any, Any, Any],
) -> _Comparison:
    """Runs the three trainings and measures them (see `check_exactness`)."""
    keep = _compared(model)

    def kept(snapshots: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
        return [[weights[i] for i in keep] for weights in snapshots]

    start = kept([model.get_weights()])[0]
    clone, swapped, accumulated = _trained(
        model, optimizer, True, k, batch_size, data
    )
    window_loss = _inner(clone.optimizer).window_loss
    window_loss = float(keras.ops.convert_to_numpy(window_loss))
    clone, _, big = _trained(model, optimizer, False, k, batch_size, data)
    loss_reductions = _loss_reductions(clone, data, batch_size)
    _, _, reordered = _trained(model, optimizer, False, k, batch_size, shuffled)
    accumulated, big, reordered = map(kept, (accumulated, big, reordered))
    random_layers_off = swapped and any(
        _runs.is_random_layer(layer)
        for layer in _keras_private.sublayers(model)
    )
    notes = []
    if random_layers_off:
        notes.append(
            "random layers ran with training=False in every run "
            "(see the random_layers cause)"
        )
    return _Comparison(
        table=variable_drifts(
            [model.weights[i].path for i in keep],
            start,
            big,
            accumulated,
            reordered,
        ),
        drift=per_update(accumulated, big),
        floor=per_update(reordered, big),
        notes=notes,
        facts={
            "loss_reductions": loss_reductions,
            "window_loss_missing": bool(np.isnan(window_loss)),
            "random_layers_off": random_layers_off,
        },
    )


def _compared(model: keras.Model) -> list[int]:
    """The indices of `model.weights` to compare: all but the pending
    window of `AccumBatchNormalization` layers, which the big-batch runs
    (`accum_iters=1`) never hold."""
    from accum_optimizers.layers import AccumBatchNormalization

    window = {
        id(v)
        for layer in _keras_private.sublayers(model)
        if isinstance(layer, AccumBatchNormalization)
        for v in (
            layer.window_count,
            layer.window_mean,
            layer.window_m2,
            layer.window_calls,
        )
    }
    return [i for i, v in enumerate(model.weights) if id(v) not in window]


def _loss_reductions(
    clone: keras.Model, data: tuple[Any, Any, Any], batch_size: int
) -> list[Any]:
    """The Keras loss reductions of one micro-batch's loss (eagerly, no
    training step)."""
    x, y, sample_weight = (_runs.take(d, np.arange(batch_size)) for d in data)
    with _keras_private.recorded_loss_reductions() as reductions:
        y_pred = clone(x, training=False)
        clone.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    return list(reductions)


def _inner(optimizer: keras.optimizers.Optimizer) -> Any:
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def model_optimizer(
    model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None
) -> keras.optimizers.Optimizer:
    """The accumulating optimizer to check: `optimizer`, or `model`'s;
    raises `ValueError` naming what is wrong."""
    if not isinstance(model, keras.Model):
        raise ValueError(
            "`model` must be a `keras.Model`. Received: "
            f"model={model!r} of type {type(model).__name__}"
        )
    if not model.compiled or getattr(model, "loss", None) is None:
        raise ValueError(
            "`model` must be compiled with its loss (check_exactness "
            f"trains clones with it). Received: model={model.name!r}, "
            "not compiled"
        )
    if not model.built or not model.weights:
        raise ValueError(
            "`model` must be built (give it an `Input`). Received: "
            f"model={model.name!r}, not built"
        )
    optimizer = model.optimizer if optimizer is None else optimizer
    inner = _inner(optimizer)
    if _keras_private.is_multi_optimizer(inner) or not isinstance(
        inner, GradientAccumulation
    ):
        raise ValueError(
            "check_exactness needs an accumulating optimizer (an "
            "`accum_optimizers` class or `accumulating(cls)`, possibly in "
            "a `LossScaleOptimizer`), compiled with the model or passed as "
            f"`optimizer=`. Received: optimizer={optimizer!r}"
        )
    if not isinstance(inner.accum_iters, (int, np.integer)):
        raise ValueError(
            "check_exactness compares windows of one size: an "
            "`accum_iters` schedule has no single big batch. Received: "
            f"accum_iters={inner.accum_iters!r}"
        )
    learning_rate = inner.get_config()["learning_rate"]
    if isinstance(learning_rate, dict):
        learning_rate = keras.saving.deserialize_keras_object(learning_rate)
    if schedules.keyed_on_samples(learning_rate):
        raise ValueError(
            "check_exactness compares with the parent Keras optimizer, "
            "which cannot key a learning rate on samples (`by_samples`). "
            f"Received: learning_rate={learning_rate!r}"
        )
    if follows_window(learning_rate):
        raise ValueError(
            "check_exactness compares with the parent Keras optimizer at a "
            "fixed learning rate; AdaScale and the scaling rules scale it "
            "by each window's gain or size. Check the model with the base "
            f"learning rate instead. Received: learning_rate={learning_rate!r}"
        )
    return optimizer
