"""torch: in-place `torch._foreach_*` adds, and sums zeroed at the window's
end (eager torch has no fused select to make overwriting cheaper)."""

import torch

from accum_optimizers import _keras_private
from accum_optimizers._backend.base import Accumulation


class TorchAccumulation(Accumulation):
    @torch.no_grad()
    def _accum_add(self, sums, grads, new_window, weight=None):
        # `_accum_end_window` zeroed the sums: a new window needs no select.
        # A weight known on the host multiplies inside the add (`alpha`).
        alpha = weight if isinstance(weight, float) else 1
        if weight is not None and not isinstance(weight, float):
            grads = self._accum_weighed(sums, grads, weight)
        pairs = [(s, g) for s, g in zip(sums, grads) if g is not None]
        targets = [total.value for total, _ in pairs]
        sources = [
            torch.as_tensor(grad, dtype=target.dtype, device=target.device)
            for (_, grad), target in zip(pairs, targets)
        ]
        if targets:
            _keras_private.torch_foreach_add_(targets, sources, alpha=alpha)

    @torch.no_grad()
    def _accum_window_mean(self, totals, count):
        # In place: `totals` are the sums, which `_accum_end_window` zeroes
        # next; new tensors would cost an allocation per variable.
        if totals:
            _keras_private.torch_foreach_div_(totals, count)
        return totals

    @torch.no_grad()
    def _accum_end_window(self):
        variables = self._accum_sums + [
            self._accum_micro_steps,
            self._accum_extra_weight,
        ]
        _keras_private.torch_foreach_zero_(
            [variable.value for variable in variables]
        )
