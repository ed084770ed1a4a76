"""`apply` run in each execution mode the current backend offers.

`MODES` names them; `applier(optimizer, variables, mode)` returns a function
`(grads) -> None` that applies one micro-step's gradients (`None` for a
variable without one) in that mode: eagerly, in a TensorFlow graph
(`tf.function`), under XLA (`jit_compile=True`), or under `jax.jit` through
`stateless_apply`. With `subset=True` the eager and TensorFlow modes pass
only the variables that have a gradient, as custom loops that filter
`None` gradients do.
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

        def step(grads):
            optimizer.apply(*pairs(grads))

        return step
    if mode in ("graph", "xla"):
        import tensorflow as tf

        compiled = {}  # one graph per set of variables passed

        def step(grads):
            kept_grads, kept_variables = pairs(grads)
            key = tuple(id(v) for v in kept_variables)
            if key not in compiled:

                @tf.function(jit_compile=mode == "xla")
                def function(kept_grads):
                    optimizer.apply(kept_grads, kept_variables)

                compiled[key] = function
            compiled[key](kept_grads)

        return step
    if mode == "jit":
        import jax

        @jax.jit
        def pure(opt_state, trainable, grads):
            return optimizer.stateless_apply(opt_state, grads, trainable)

        def step(grads):
            trainable, opt_state = pure(
                [v.value for v in optimizer.variables],
                [v.value for v in variables],
                grads,
            )
            for variable, value in zip(variables, trainable):
                variable.assign(value)
            for variable, value in zip(optimizer.variables, opt_state):
                variable.assign(value)

        return step
    raise ValueError(f"Unknown mode: {mode!r}")
