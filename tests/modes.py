"""`apply` run in each execution mode the current backend offers.

`MODES` names them; `applier(optimizer, variables, mode)` returns a function
`(grads, weight=None, loss=None) -> None` that applies one micro-step's
gradients (`None` for a variable without one), with `apply`'s `weight` and
`loss`, in that
mode: eagerly, in a TensorFlow graph (`tf.function`), under XLA
(`jit_compile=True`), or under `jax.jit` through `stateless_apply`. With
`subset=True` the eager and TensorFlow modes pass only the variables that
have a gradient, as custom loops that filter `None` gradients do.
"""

import keras

BACKEND = keras.backend.backend()

MODES = {
    "tensorflow": ["eager", "graph", "xla"],
    "jax": ["eager", "jit"],
    "torch": ["eager"],
}[BACKEND]


def applier(optimizer, variables, mode, subset=False):
    optimizer.build(variables)

    def pairs(grads):
        kept = [
            (g, v)
            for g, v in zip(grads, variables)
            if g is not None or not subset
        ]
        return [g for g, _ in kept], [v for _, v in kept]

    if mode == "eager":

        def step(grads, weight=None, loss=None):
            optimizer.apply(*pairs(grads), **_weight(weight, loss))

        return step
    if mode in ("graph", "xla"):
        import tensorflow as tf

        compiled = {}  # one graph per set of variables passed

        def step(grads, weight=None, loss=None):
            kept_grads, kept_variables = pairs(grads)
            key = (
                tuple(id(v) for v in kept_variables),
                weight is None,
                loss is None,
            )
            if key not in compiled:

                @tf.function(jit_compile=mode == "xla")
                def function(kept_grads, weight, loss):
                    optimizer.apply(
                        kept_grads, kept_variables, **_weight(weight, loss)
                    )

                compiled[key] = function
            if weight is not None:  # traced, as a tensor
                weight = tf.convert_to_tensor(weight, "float32")
            if loss is not None:
                loss = tf.convert_to_tensor(loss, "float32")
            compiled[key](kept_grads, weight, loss)

        return step
    if mode == "jit":
        import jax

        @jax.jit
        def pure(opt_state, trainable, grads, weight, loss):
            return optimizer.stateless_apply(
                opt_state, grads, trainable, **_weight(weight, loss)
            )

        def step(grads, weight=None, loss=None):
            trainable, opt_state = pure(
                [v.value for v in optimizer.variables],
                [v.value for v in variables],
                grads,
                weight,
                loss,
            )
            for variable, value in zip(variables, trainable):
                variable.assign(value)
            for variable, value in zip(optimizer.variables, opt_state):
                variable.assign(value)

        return step
    raise ValueError(f"Unknown mode: {mode!r}")


def _weight(weight, loss=None):
    """`apply`'s keywords for `weight` and `loss`; none for `None`, so that
    plain Keras optimizers run through the same modes."""
    keywords = {} if weight is None else {"weight": weight}
    if loss is not None:
        keywords["loss"] = loss
    return keywords
