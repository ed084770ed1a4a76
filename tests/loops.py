"""Custom training loops, one per backend: the only backend-specific test code.

`gradients(model, x, y)` returns the gradients of the mean-squared-error loss
of `model` on `(x, y)` with respect to `model.trainable_variables`, computed
the way a user's hand-written loop on that backend computes them
(`tf.GradientTape`, `jax.grad` over `stateless_call`, `loss.backward()`).
`train_in_batches(optimizer, model, x, y, batch_size)` applies the gradients
of each consecutive batch in such a loop.
`compiled_step(model, optimizer)` returns a function `(x, y) -> None` that
computes the gradients and applies them inside the backend's compiler
(`tf.function`, `jax.jit` with `stateless_apply`); it is `None` on torch.
"""

import keras
from keras import ops

BACKEND = keras.backend.backend()


def mse(model, x, y):
    y_pred = model(ops.convert_to_tensor(x), training=True)
    return ops.mean(ops.square(y_pred - ops.convert_to_tensor(y)))


if BACKEND == "tensorflow":
    import tensorflow as tf

    def gradients(model, x, y):
        with tf.GradientTape() as tape:
            loss = mse(model, x, y)
        return tape.gradient(loss, model.trainable_variables)

    def compiled_step(model, optimizer):
        @tf.function(jit_compile=False)
        def step(x, y):
            grads = gradients(model, x, y)
            optimizer.apply(grads, model.trainable_variables)

        return step

elif BACKEND == "jax":
    import jax

    def _loss(trainable, non_trainable, model, x, y):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x)
        return ops.mean(ops.square(y_pred - y))

    def gradients(model, x, y):
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        return jax.grad(_loss)(trainable, non_trainable, model, x, y)

    def compiled_step(model, optimizer):
        optimizer.build(model.trainable_variables)

        @jax.jit
        def pure_step(trainable, non_trainable, opt_state, x, y):
            grads = jax.grad(_loss)(trainable, non_trainable, model, x, y)
            return optimizer.stateless_apply(opt_state, grads, trainable)

        def step(x, y):
            trainable, opt_state = pure_step(
                [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                [v.value for v in optimizer.variables],
                x,
                y,
            )
            for variable, value in zip(model.trainable_variables, trainable):
                variable.assign(value)
            for variable, value in zip(optimizer.variables, opt_state):
                variable.assign(value)

        return step

elif BACKEND == "torch":

    def gradients(model, x, y):
        model.zero_grad()
        loss = mse(model, x, y)
        loss.backward()
        return [v.value.grad.clone() for v in model.trainable_variables]

    def compiled_step(model, optimizer):
        return None


def train_in_batches(optimizer, model, x, y, batch_size):
    """A custom loop over `x, y` in consecutive batches of `batch_size`:
    `optimizer.apply` of each batch's `gradients` (the big-batch oracle of
    the custom-loop tests)."""
    for start in range(0, len(x), batch_size):
        rows = slice(start, start + batch_size)
        optimizer.apply(
            gradients(model, x[rows], y[rows]), model.trainable_variables
        )


def apply(optimizer, grads, variables):
    """`optimizer.apply`, through `stateless_apply` on JAX, as its trainer
    does (Keras' `LossScaleOptimizer.apply` only works statelessly there)."""
    if BACKEND != "jax":
        optimizer.apply(grads, variables)
        return
    optimizer.build(variables)
    new_values, new_state = optimizer.stateless_apply(
        [v.value for v in optimizer.variables],
        grads,
        [v.value for v in variables],
    )
    for variable, value in zip(variables, new_values):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, new_state):
        variable.assign(value)
