"""`AccumSchedule`, the base class of accumulation schedules (public as
`accum_optimizers.schedules.AccumSchedule`), apart so that schedules kept in
other modules (`_noise_schedule.py`) derive from it without importing
`schedules`, which exports them."""

from __future__ import annotations

from typing import Any


class AccumSchedule:
    """Base class of accumulation schedules.

    Subclasses implement `__call__(update)`, which takes the number of
    applied updates (an int32 scalar tensor, or a Python int) and returns
    the window size `k >= 1` for the next update, written with `keras.ops`
    so that it runs in compiled code; and `get_config()`.
    `min_accum_iters` is the smallest window it returns (`1` if unknown):
    `AccumulationLogger` reads it to know whether an execution of
    `steps_per_execution` micro-batches can close several windows.
    """

    min_accum_iters = 1

    def __call__(self, update: Any) -> Any:
        """The window size for the next update.

        Args:
            update: the number of applied updates: an int32 scalar tensor
                or a Python int (the samples seen, a float32 scalar, for a
                schedule passed to `by_samples`).

        Returns:
            An int32 scalar tensor >= 1.
        """
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        """The schedule's constructor arguments, for `from_config`."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AccumSchedule:
        """The schedule `get_config` described: `cls(**config)`."""
        return cls(**config)

    def __repr__(self) -> str:
        arguments = ", ".join(
            f"{name}={value!r}" for name, value in self.get_config().items()
        )
        return f"{type(self).__name__}({arguments})"
