"""Adam that accumulates gradients over `accum_iters` micro-batches."""

from keras import optimizers
from keras.saving import register_keras_serializable

from accum_optimizers import _backend
from accum_optimizers._accumulation import GradientAccumulation
from accum_optimizers._accumulation import default_epsilon
from accum_optimizers._docs import ACCUMULATION_ARGS
from accum_optimizers._docs import PARENT_ARGS


@register_keras_serializable(package="accum_optimizers")
class AdamAccumulate(
    GradientAccumulation, _backend.fused_parent(optimizers.Adam)
):
    """Adam that updates the weights once per `accum_iters` micro-batches.

    Each call to `apply` adds its gradients into per-variable accumulators;
    every `accum_iters`-th call applies their mean through `keras.optimizers.
    Adam`, so `accum_iters` micro-batches of size `b` train exactly like one
    batch of size `accum_iters * b`. `iterations` counts applied updates.

    ```python
    model.compile(optimizer=AdamAccumulate(accum_iters=5), loss="mse")
    model.fit(x, y, batch_size=10)  # trains like batch_size=50
    ```

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or a
            callable that takes no arguments and returns the value to use.
            Schedules are called with the number of applied updates.
            Defaults to `0.001`.
        beta_1: Float. Exponential decay rate of the 1st moment estimates.
            Defaults to `0.9`.
        beta_2: Float. Exponential decay rate of the 2nd moment estimates.
            Defaults to `0.999`.
        epsilon: Small constant for numerical stability ("epsilon hat" in
            Kingma and Ba). `None` means Keras' default epsilon
            (`keras.config.epsilon()`). Defaults to `1e-7`.
        amsgrad: Boolean. Whether to apply the AMSGrad variant. Defaults to
            `False`.
        {parent_args}
        {accumulation_args}
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        amsgrad=False,
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
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=default_epsilon(epsilon),
            amsgrad=amsgrad,
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


AdamAccumulate.__doc__ = AdamAccumulate.__doc__.format(
    parent_args=PARENT_ARGS, accumulation_args=ACCUMULATION_ARGS
)
