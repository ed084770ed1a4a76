"""Accumulation schedules: the window size as a function of applied updates.

`accum_iters` takes an integer, a dict `{update: k}`, or an `AccumSchedule`.
The window that produces update `t` (counting from 0) averages `k(t)`
micro-batches, so a run at micro-batch `b` trains exactly like the parent
optimizer on batches of `k(t) * b`: a batch-size ramp.

```python
# Batch 32 for 1000 updates, then 64, then 128 (micro-batches of 32):
optimizer = AdamAccumulate(accum_iters={0: 1, 1000: 2, 5000: 4})
# From 1 to 8 micro-batches over the first 2000 updates:
optimizer = AdamAccumulate(accum_iters=LinearRamp(1, 8, ramp_updates=2000))
```
"""

from keras import ops
from keras.saving import register_keras_serializable

from accum_optimizers._validation import validate_accum_iters
from accum_optimizers._validation import validate_boundaries

_PACKAGE = "accum_optimizers"


def get(identifier):
    """The window size `accum_iters` names: an `int`, or an `AccumSchedule`.

    Args:
        identifier: an integer >= 1, a dict `{update: k}` (a dict with the
            single key `0` is the constant it holds), or an `AccumSchedule`.

    Returns:
        The integer, or the schedule (a dict becomes a
        `PiecewiseConstantAccumIters`).
    """
    if isinstance(identifier, AccumSchedule):
        return identifier
    if isinstance(identifier, dict):
        boundaries = validate_boundaries(identifier)
        if len(boundaries) == 1:
            return boundaries[0]
        return PiecewiseConstantAccumIters(boundaries)
    return validate_accum_iters(identifier)


class AccumSchedule:
    """Base class of accumulation schedules.

    Subclasses implement `__call__(update)`, which takes the number of
    applied updates (an int32 scalar tensor, or a Python int) and returns
    the window size `k >= 1` for the next update, written with `keras.ops`
    so that it runs in compiled code; and `get_config()`. The schedule
    should also say the smallest window it returns in `min_accum_iters`
    (`1` if unknown).
    """

    min_accum_iters = 1

    def __call__(self, update):
        raise NotImplementedError

    def get_config(self):
        raise NotImplementedError

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        arguments = ", ".join(
            f"{name}={value!r}" for name, value in self.get_config().items()
        )
        return f"{type(self).__name__}({arguments})"


@register_keras_serializable(package=_PACKAGE)
class PiecewiseConstantAccumIters(AccumSchedule):
    """`k` changes at given update counts: what a dict `accum_iters` means.

    Args:
        boundaries: dict `{update: k}`; keys are applied-update counts, the
            first is `0`; values are integers `>= 1`.
    """

    def __init__(self, boundaries):
        self.boundaries = validate_boundaries(boundaries)
        self.min_accum_iters = min(self.boundaries.values())

    def __call__(self, update):
        update = ops.cast(update, "int32")
        window = ops.convert_to_tensor(self.boundaries[0], "int32")
        for start, size in sorted(self.boundaries.items())[1:]:
            window = ops.where(
                ops.greater_equal(update, start),
                ops.convert_to_tensor(size, "int32"),
                window,
            )
        return window

    def get_config(self):
        return {"boundaries": dict(self.boundaries)}


@register_keras_serializable(package=_PACKAGE)
class LinearRamp(AccumSchedule):
    """`k` grows linearly from `initial` to `final` over `ramp_updates`.

    `k(t) = initial + floor((final - initial) * min(t, ramp_updates) /
    ramp_updates)`: the effective batch grows with the updates applied,
    then stays at `final`.

    Args:
        initial: Integer >= 1. The window size at update 0.
        final: Integer >= 1. The window size from `ramp_updates` on.
        ramp_updates: Integer >= 1. Updates over which `k` ramps.
    """

    def __init__(self, initial, final, ramp_updates):
        for name, value in (
            ("initial", initial),
            ("final", final),
            ("ramp_updates", ramp_updates),
        ):
            try:
                validate_accum_iters(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"`{name}` must be an integer >= 1. Received: "
                    f"{name}={value!r}"
                ) from None
        self.initial, self.final = int(initial), int(final)
        self.ramp_updates = int(ramp_updates)
        self.min_accum_iters = min(self.initial, self.final)

    def __call__(self, update):
        progress = ops.minimum(ops.cast(update, "int32"), self.ramp_updates)
        growth = ops.floor_divide(
            ops.multiply(progress, self.final - self.initial),
            self.ramp_updates,
        )
        return ops.cast(ops.add(growth, self.initial), "int32")

    def get_config(self):
        return {
            "initial": self.initial,
            "final": self.final,
            "ramp_updates": self.ramp_updates,
        }
