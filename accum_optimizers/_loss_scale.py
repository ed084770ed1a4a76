"""Weights-only resume of a `LossScaleOptimizer` around an accumulating one.

`compile` under the `mixed_float16` policy wraps the optimizer in a
`keras.optimizers.LossScaleOptimizer`, unbuilt until the first train step.
`model.load_weights` then finds it unbuilt and skips its state, the dynamic
loss scale and its step counter, with a warning only, while the inner
optimizer keeps its own (it restores when built): training resumes with the
initial loss scale, and so skips and scales steps the uninterrupted run did
not. For a `LossScaleOptimizer` whose inner optimizer accumulates, the saved
state is kept instead and restored when it builds, as the inner optimizer's
is; any other `LossScaleOptimizer` behaves as Keras wrote it.

In a custom loop, `LossScaleOptimizer.apply` and `stateless_apply` take no
`weight` or `loss`; around an accumulating optimizer they take them here and
hand them to the inner optimizer's `apply` (which checks the weight), as
keywords of its own. `fit` hands the loss to `scale_loss`, which passes it
on to the inner optimizer (`window_loss`).
"""

import threading

import keras
import numpy as np


def _accumulates(optimizer):
    from accum_optimizers._accumulation import GradientAccumulation

    return isinstance(optimizer.inner_optimizer, GradientAccumulation)


def install():
    """Patches `LossScaleOptimizer`'s `load_own_variables`, `build`,
    `apply`, `stateless_apply` and `scale_loss` (once)."""
    cls = keras.optimizers.LossScaleOptimizer
    if getattr(cls, "_accum_resumes_weights_only", False):
        return
    load_own_variables, build = cls.load_own_variables, cls.build
    apply, stateless_apply = cls.apply, cls.stateless_apply
    scale_loss = cls.scale_loss

    def weighing(method):
        def weighed(self, *args, weight=None, loss=None, **kwargs):
            if weight is None and loss is None:
                return method(self, *args, **kwargs)
            if not _accumulates(self):
                raise TypeError(
                    f"LossScaleOptimizer.{method.__name__}() takes `weight` "
                    "and `loss` only around an accumulating optimizer. "
                    f"Received: inner_optimizer={self.inner_optimizer!r}"
                )
            inner = self.inner_optimizer
            if weight is not None:
                inner._accum_hand_over(weight, check=True)
            if loss is not None:
                inner._accum_losses_of_threads()[threading.get_ident()] = loss
            try:
                return method(self, *args, **kwargs)
            finally:
                # Left over when the step was skipped (gradients not
                # finite) or raised before the inner optimizer's `apply`.
                inner._accum_take_handoff()
                inner._accum_losses_of_threads().pop(
                    threading.get_ident(), None
                )

        weighed.__name__ = method.__name__
        weighed.__doc__ = method.__doc__
        return weighed

    def deferring_load_own_variables(self, store):
        if self.built or not _accumulates(self):
            return load_own_variables(self, store)
        values = [np.array(store[str(i)]) for i in range(len(store.keys()))]
        self._accum_pending_scale_state = tuple(values)

    def restoring_build(self, var_list):
        pending = self.__dict__.pop("_accum_pending_scale_state", None)
        # The inner optimizer's own saved state (its part of `pending`),
        # kept for its build when it was saved trained.
        inner = self.inner_optimizer.__dict__.get("_accum_pending_restore")
        build(self, var_list)
        if pending is None or inner is None:
            return  # Saved untrained: a fresh loss scale is the saved one.
        inner_ids = {id(v) for v in self.inner_optimizer.variables}
        own = [v for v in self.variables if id(v) not in inner_ids]
        saved = pending[: len(pending) - len(inner)]
        if len(saved) != len(own) or any(
            np.shape(value) != tuple(variable.shape)
            for value, variable in zip(saved, own)
        ):
            raise ValueError(
                f"Cannot restore the state of optimizer '{self.name}' "
                "(LossScaleOptimizer): the checkpoint holds "
                f"{len(saved)} variables of its own (loss scale and step "
                f"counter), this one has {len(own)}."
            )
        # TensorFlow builds it while tracing the first train step: assign
        # once, now, not in the traced step.
        with self.inner_optimizer._accum_outside_compiled_code():
            for variable, value in zip(own, saved):
                variable.assign(value)

    def noting_scale_loss(self, loss):
        # `fit` hands the loss to the optimizer it compiled with: the
        # inner optimizer's `window_loss` needs it too.
        if _accumulates(self):
            self.inner_optimizer._accum_note_loss(loss)
        return scale_loss(self, loss)

    cls.apply = weighing(apply)
    cls.scale_loss = noting_scale_loss
    cls.stateless_apply = weighing(stateless_apply)
    cls.load_own_variables = deferring_load_own_variables
    cls.build = restoring_build
    cls._accum_resumes_weights_only = True


install()
