"""Argument docs shared by the accumulating optimizers' docstrings.

Each text is inserted after 8 spaces of indentation: its first line carries
none, the following lines carry their own.
"""

PARENT_ARGS = """\
weight_decay: Float. If set, decoupled weight decay is applied once
            per applied update.
        clipnorm: Float. If set, the mean gradient of each weight is clipped
            so that its norm is no higher than this value.
        clipvalue: Float. If set, the mean gradient of each weight is clipped
            to be no higher than this value.
        global_clipnorm: Float. If set, the mean gradients of all weights are
            clipped so that their global norm is no higher than this value.
        use_ema: Boolean. If `True`, an exponential moving average of the
            weights is kept, updated once per applied update. Defaults to
            `False`.
        ema_momentum: Float. Momentum of the weights' moving average, used
            when `use_ema=True`. Defaults to `0.99`.
        ema_overwrite_frequency: Int or `None`. With `use_ema=True`, every
            `ema_overwrite_frequency` applied updates the weights are
            overwritten by their moving average. Defaults to `None`.
        loss_scale_factor: Float or `None`. If set, the loss is multiplied by
            this factor before gradients are computed, and the gradients are
            divided by it before they are applied. Defaults to `None`.
        gradient_accumulation_steps: Keras' own accumulation. Only allowed
            with `accum_iters=1`; passing both is refused. Defaults to
            `None`.
        name: String. The name of the optimizer and the prefix of its
            variables. Defaults to a unique name from the class name."""

ACCUMULATION_ARGS = """\
accum_iters: Integer >= 1. Number of micro-batches (`apply` calls)
            whose gradients are averaged into one update. Defaults to `1`,
            which behaves exactly like the parent optimizer.
        accumulator_dtype: Dtype of the gradient accumulators. Defaults to
            `None`: `"float32"` for `float16`/`bfloat16` variables, the
            variable's own dtype otherwise.
        lr: Deprecated Keras 2 alias of `learning_rate`; warns.
        decay: Deprecated Keras 2 time decay (`learning_rate /
            (1 + decay * iterations)`, `iterations` counting applied
            updates); warns. Defaults to `None`."""
