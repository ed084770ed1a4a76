"""What `check_exactness` returns: the drift of each variable against the
round-off floor, the verdict, and the known causes found in the model."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Sequence

import numpy as np

# Drift up to this multiple of the floor reads as exact: the floor is one
# draw of the round-off, and a real difference (a missed update, a wrong
# step number, per-micro-batch statistics) is orders of magnitude larger.
FLOOR_MULTIPLE = 10.0

# Where reordering happens to change nothing (a floor of 0), a few float32
# units in the last place of the variable's largest entry still read as
# round-off.
ROUNDOFF_ULPS = 8 * float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class Cause:
    """A known cause of non-equivalence found in the model or its setup.

    Attributes:
        name: a short identifier, e.g. `"batch_statistics"`.
        where: what in the model or the data it was found in.
        remedy: what to do about it (or why it differs by design).
    """

    name: str
    where: str
    remedy: str


@dataclasses.dataclass(frozen=True)
class VariableDrift:
    """One variable's comparison, over all the checked updates.

    Attributes:
        path: the variable's path in the model.
        moved: the largest |w_end - w_start| of the big-batch run.
        drift: the largest |w_accumulated - w_big_batch| after any update.
        floor: the largest |w_reordered - w_big_batch| after any update.
        tolerance: the drift that still reads as round-off.
    """

    path: str
    moved: float
    drift: float
    floor: float
    tolerance: float

    @property
    def exact(self) -> bool:
        """Whether `drift` stays within `tolerance`."""
        return self.drift <= self.tolerance

    @property
    def drift_over_moved(self) -> float:
        """`drift` relative to `moved` (infinite where it did not move)."""
        return self.drift / self.moved if self.moved else float("inf")


def variable_drifts(
    paths: Sequence[str],
    start: Sequence[np.ndarray],
    big: Sequence[Sequence[np.ndarray]],
    accumulated: Sequence[Sequence[np.ndarray]],
    reordered: Sequence[Sequence[np.ndarray]],
) -> list[VariableDrift]:
    """One `VariableDrift` per variable.

    Args:
        paths: the variables' paths.
        start: their values before training (numpy arrays).
        big, accumulated, reordered: per update, the values after it in
            each run.
    """
    drifts = []
    for i, path in enumerate(paths):
        largest = np.max(np.abs(big[-1][i]), initial=0.0)
        floor = _largest_difference(reordered, big, i)
        drifts.append(
            VariableDrift(
                path=path,
                moved=float(np.max(np.abs(big[-1][i] - start[i]), initial=0)),
                drift=_largest_difference(accumulated, big, i),
                floor=floor,
                tolerance=float(
                    FLOOR_MULTIPLE * floor + ROUNDOFF_ULPS * largest
                ),
            )
        )
    return drifts


def _largest_difference(
    run: Sequence[Sequence[np.ndarray]],
    reference: Sequence[Sequence[np.ndarray]],
    i: int,
) -> float:
    """The largest |difference| of variable `i` after any update."""
    return float(
        max(
            np.max(np.abs(a[i] - b[i]), initial=0.0)
            for a, b in zip(run, reference)
        )
    )


def per_update(
    runs: Sequence[Sequence[np.ndarray]], big: Sequence[Sequence[np.ndarray]]
) -> list[float]:
    """The largest |difference| over all variables after each update."""
    return [
        float(max(np.max(np.abs(a - b), initial=0.0) for a, b in zip(x, y)))
        for x, y in zip(runs, big)
    ]


@dataclasses.dataclass
class ExactnessReport:
    """The answer of `check_exactness`.

    Attributes:
        exact: whether every variable's drift stays within its tolerance
            (`FLOOR_MULTIPLE` times its round-off floor, plus a few ulps).
        optimizer: the accumulating optimizer checked, as
            `"AdamAccumulate(accum_iters=4)"`.
        batch_size: the micro-batch size `b`.
        accum_iters: `k`; the big batches have `k * b` samples.
        updates: the number of updates (windows) compared.
        drift: per update, the largest |w_accumulated - w_big_batch|.
        floor: per update, the largest |w_reordered - w_big_batch|.
        table: one `VariableDrift` per variable of the model.
        causes: the known causes of non-equivalence found (`Cause`).
        notes: how the check ran where that matters (random layers).
    """

    exact: bool
    optimizer: str
    batch_size: int
    accum_iters: int
    updates: int
    drift: list[float]
    floor: list[float]
    table: list[VariableDrift]
    causes: list[Cause]
    notes: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self, max_rows: int = 12) -> list[str]:
        """The report as text lines.

        Args:
            max_rows: Integer. The most variables listed: those that drift
                most, relative to their tolerance, when there are more.
                Defaults to `12`.

        Returns:
            The lines, without line ends.
        """
        big = self.accum_iters * self.batch_size
        lines = [
            f"{self.optimizer} at batch_size={self.batch_size} against its "
            f"parent at batch_size={big}, {self.updates} updates:"
        ]
        rows = sorted(
            self.table,
            key=_drift_over_tolerance,
            reverse=True,
        )
        shown = self.table if len(rows) <= max_rows else rows[:max_rows]
        width = max([8] + [len(v.path) for v in shown])
        lines.append(
            f"  {'variable':<{width}}  {'moved':>8}  {'drift':>8}  "
            f"{'floor':>8}  {'drift/moved':>11}"
        )
        for v in shown:
            lines.append(
                f"  {v.path:<{width}}  {v.moved:8.1e}  {v.drift:8.1e}  "
                f"{v.floor:8.1e}  {v.drift_over_moved:11.1e}"
                + ("" if v.exact else "  <- drifts")
            )
        hidden = rows[max_rows:] if len(rows) > max_rows else []
        if hidden:
            drifting = sum(not v.exact for v in hidden)
            lines.append(
                f"  ... {len(hidden)} more variables, {drifting} drifting"
            )
        shown_updates = _spread(self.updates, 5)
        lines.append(
            "  after update " + "".join(f"{u:>9d}" for u in shown_updates)
        )
        for name, values in (("drift", self.drift), ("floor", self.floor)):
            lines.append(
                f"  {name:<12} "
                + "".join(f"{values[u - 1]:9.1e}" for u in shown_updates)
            )
        verdict = (
            "exact: the drift is within the round-off floor"
            if self.exact
            else "NOT exact: drift beyond "
            f"{FLOOR_MULTIPLE:g}x the round-off floor"
        )
        lines.append(verdict)
        for note in self.notes:
            lines.extend(_wrap(f"note: {note}", "", "  "))
        if not self.causes:
            lines.append("known causes found: none")
        for cause in self.causes:
            cause_line = f"cause: {cause.name} ({cause.where})"
            lines.extend(_wrap(cause_line, "", "  "))
            lines.extend(_wrap(f"remedy: {cause.remedy}", "  ", "    "))
        return lines


def _spread(updates: int, count: int) -> list[int]:
    """Up to `count` update numbers from 1 to `updates`, evenly spread."""
    if updates <= count:
        return list(range(1, updates + 1))
    step = updates / (count - 1)
    return sorted({1} | {round(i * step) for i in range(1, count)})


def _drift_over_tolerance(variable: VariableDrift) -> float:
    if variable.tolerance:
        return variable.drift / variable.tolerance
    return np.inf if variable.drift else 0.0


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(
        text,
        width=76,
        initial_indent=first,
        subsequent_indent=rest,
        break_on_hyphens=False,
    )
