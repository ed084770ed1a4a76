"""The ceiling configuration: an optimizer that only adds the gradients into
one buffer per variable (forward + backward + add, no update), the physical
floor of an accumulating micro-step. The add is each backend's cheapest:
the optimizer's `assign_add` on TensorFlow (it scatters `IndexedSlices`),
one fused `torch._foreach_add_` on torch, a plain `+` (updated in place by
XLA under `jax.jit`) on JAX."""

import keras
from keras import backend


class AddOnly(keras.optimizers.Optimizer):
    def __init__(self, name="add_only"):
        super().__init__(learning_rate=0.0, name=name)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._buffers = self.add_optimizer_variables(variables, "buffer")

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        if backend.backend() == "torch":
            import torch

            with torch.no_grad():
                torch._foreach_add_([b.value for b in self._buffers], grads)
        else:
            for buffer, grad in zip(self._buffers, grads):
                self.assign_add(buffer, grad)
        self._iterations.assign_add(1)
