"""The ceiling configuration: an optimizer that only adds the gradients into
one buffer per variable (forward + backward + add, no update), the physical
floor of an accumulating micro-step."""

import keras

from accum_optimizers import _backend


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
        _backend.add_into(self, self._buffers, grads)
        self._iterations.assign_add(1)
