"""A `keras.optimizers.MultiOptimizer` of accumulating optimizers.

It hands each inner optimizer the gradients of its own variables, and the
loss to none of them. Patched here (once, on import, where the installed
Keras has it):

- `scale_loss` passes `fit`'s loss on to the inner accumulating optimizers
  (`window_loss`);
- `apply` checks every gradient for finiteness once and hands the result
  to the inner optimizers with `skip_nonfinite=True`, so that they skip the
  same micro-batches: each checking only its own variables would let one
  skip a micro-batch that another adds, and their windows drift apart.
"""

import threading

import keras

from accum_optimizers._finite import all_finite


def _accumulating(multi_optimizer):
    from accum_optimizers._accumulation import GradientAccumulation

    return [
        optimizer
        for optimizer in multi_optimizer.optimizers
        if isinstance(optimizer, GradientAccumulation)
        and optimizer._accumulates
    ]


def install():
    """Patches `MultiOptimizer.scale_loss` and `apply` (once)."""
    cls = getattr(keras.optimizers, "MultiOptimizer", None)
    if cls is None or getattr(cls, "_accum_hands_over", False):
        return
    scale_loss, apply = cls.scale_loss, cls.apply

    def noting_scale_loss(self, loss):
        for optimizer in _accumulating(self):
            optimizer._accum_note_loss(loss)
        return scale_loss(self, loss)

    def agreeing_apply(self, grads, trainable_variables=None):
        skipping = [o for o in _accumulating(self) if o.skip_nonfinite]
        if skipping and len(grads):
            finite = all_finite(grads)
            for optimizer in skipping:
                optimizer._accum_finite_of_threads()[threading.get_ident()] = (
                    finite
                )
        try:
            return apply(self, grads, trainable_variables)
        finally:
            for optimizer in skipping:
                optimizer._accum_finite_of_threads().pop(
                    threading.get_ident(), None
                )

    agreeing_apply.__doc__ = apply.__doc__
    cls.scale_loss = noting_scale_loss
    cls.apply = agreeing_apply
    cls._accum_hands_over = True


install()
