"""SGD that accumulates gradients over `accum_iters` micro-batches."""

from keras import optimizers
from keras.saving import register_keras_serializable

from accum_optimizers import _backend
from accum_optimizers._accumulation import GradientAccumulation
from accum_optimizers._docs import ACCUMULATION_ARGS
from accum_optimizers._docs import PARENT_ARGS


@register_keras_serializable(package="accum_optimizers")
class SGDAccumulate(
    GradientAccumulation, _backend.fused_parent(optimizers.SGD)
):
    """SGD (with momentum) that updates once per `accum_iters` micro-batches.

    Each call to `apply` adds its gradients into per-variable accumulators;
    every `accum_iters`-th call applies their mean through `keras.optimizers.
    SGD`, so `accum_iters` micro-batches of size `b` train exactly like one
    batch of size `accum_iters * b`. `iterations` counts applied updates.

    ```python
    model.compile(optimizer=SGDAccumulate(0.1, momentum=0.9, accum_iters=4))
    ```

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or a
            callable that takes no arguments and returns the value to use.
            Schedules are called with the number of applied updates.
            Defaults to `0.01`.
        momentum: Float >= 0 that accelerates gradient descent in the
            relevant direction and dampens oscillations. `0` is plain
            gradient descent. Defaults to `0.0`.
        nesterov: Boolean. Whether to apply Nesterov momentum. Defaults to
            `False`.
        {parent_args}
        {accumulation_args}
    """

    def __init__(
        self,
        learning_rate=0.01,
        momentum=0.0,
        nesterov=False,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        accum_iters=1,
        accumulator_dtype=None,
        **kwargs,
    ):
        super().__init__(
            learning_rate=learning_rate,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            accum_iters=accum_iters,
            accumulator_dtype=accumulator_dtype,
            **kwargs,
        )


SGDAccumulate.__doc__ = SGDAccumulate.__doc__.format(
    parent_args=PARENT_ARGS, accumulation_args=ACCUMULATION_ARGS
)
