"""The gradient-accumulation mechanism shared by every accumulating optimizer.

Over a window of `accum_iters` consecutive `apply` calls with gradients
g_1..g_k, the optimizer adds each g_i into a per-variable accumulator and
updates the weights once, on the k-th call, with the mean gradient
(g_1 + ... + g_k) / k, through the parent Keras optimizer's own `apply`:
unscaling, clipping, weight decay, the update math, EMA, constraints and the
`iterations` increment all happen exactly once per window, so `iterations`
counts applied updates and learning-rate schedules, Adam's bias correction and
EMA see the same step numbers as a run with a k times larger batch.

Each call reads

    counter -> update_switch -> accumulate, or blend and apply:

    micro_steps += 1
    update_switch = micro_steps >= accum_iters
    if update_switch:                           (once per window)
        parent.apply((accumulators + grads) / micro_steps)
        micro_steps = 0
    else:                                       (the other micro-steps)
        accumulators += grads

The `if` is a real branch on every backend (a `tf.cond` in a TensorFlow
graph, a `tf.while_loop` or `jax.lax.while_loop` that runs zero times or
once under XLA, a Python `if` on torch and eagerly), so the accumulating
micro-steps never run the update math. How each backend arranges the add
and the branch, and how it starts the next window without a pass that
zeroes the accumulators where it can, is in `_backend`. With
`accum_iters=1` the optimizer is the parent optimizer: no extra variables
and the parent's own code path.
"""

import inspect
import warnings

import keras
import numpy as np
from keras import backend
from keras import config as keras_config
from keras import ops

from accum_optimizers import _backend

_LOW_PRECISION_DTYPES = ("float16", "bfloat16")


def validate_accum_iters(accum_iters):
    """Returns `accum_iters` as an `int` >= 1, or raises naming the value."""
    if isinstance(accum_iters, (bool, np.bool_)) or not isinstance(
        accum_iters, (int, np.integer)
    ):
        raise TypeError(
            "`accum_iters` must be an integer >= 1. Received: "
            f"accum_iters={accum_iters!r} "
            f"(of type {type(accum_iters).__name__})"
        )
    if accum_iters < 1:
        raise ValueError(
            "`accum_iters` must be an integer >= 1. Received: "
            f"accum_iters={accum_iters!r}"
        )
    return int(accum_iters)


def default_epsilon(epsilon):
    """Keras 2 spelled "Keras' default epsilon" as `epsilon=None`."""
    return keras_config.epsilon() if epsilon is None else epsilon


class GradientAccumulation:
    """Mixin that makes a Keras optimizer accumulate gradients.

    Put it before the Keras optimizer in the bases:
    `class AdamAccumulate(GradientAccumulation, Adam)`. See the module
    docstring for the mechanism.

    Args:
        accum_iters: Integer >= 1. Number of micro-batches (`apply` calls)
            whose gradients are averaged into one update. Defaults to `1`,
            which is the parent optimizer unchanged.
        accumulator_dtype: Optional dtype of the gradient accumulators.
            Defaults to `None`: `"float32"` for `float16`/`bfloat16`
            variables, the variable's own dtype otherwise.
        lr: Deprecated Keras 2 alias of `learning_rate`.
        decay: Deprecated Keras 2 time decay: the learning rate is divided
            by `1 + decay * iterations`, where `iterations` counts applied
            updates. Defaults to `None` (no decay).
        **kwargs: the parent optimizer's arguments.
    """

    def __init__(
        self,
        accum_iters=1,
        accumulator_dtype=None,
        lr=None,
        decay=None,
        **kwargs,
    ):
        accum_iters = validate_accum_iters(accum_iters)
        steps = kwargs.get("gradient_accumulation_steps")
        if accum_iters > 1 and steps:
            raise ValueError(
                "Pass either `accum_iters` or Keras' own "
                "`gradient_accumulation_steps`, not both: together they would "
                "accumulate twice. Received: "
                f"accum_iters={accum_iters}, "
                f"gradient_accumulation_steps={steps!r}"
            )
        if accumulator_dtype is not None:
            accumulator_dtype = backend.standardize_dtype(accumulator_dtype)
            if "float" not in accumulator_dtype:
                raise ValueError(
                    "`accumulator_dtype` must be a floating dtype. Received: "
                    f"accumulator_dtype={accumulator_dtype!r}"
                )
        if lr is not None:
            kwargs["learning_rate"] = self._learning_rate_from_lr(
                lr, kwargs.get("learning_rate")
            )
        if decay is not None:
            warnings.warn(
                "`decay` is the Keras 2 time decay; in Keras 3 pass "
                "`learning_rate=keras.optimizers.schedules.InverseTimeDecay("
                "learning_rate, decay_steps=1, decay_rate=decay)` instead.",
                DeprecationWarning,
                stacklevel=3,
            )
            if (
                isinstance(decay, bool)
                or not isinstance(decay, (int, float, np.floating, np.integer))
                or not decay >= 0
            ):
                raise ValueError(
                    f"`decay` must be a number >= 0. Received: decay={decay!r}"
                )
            decay = float(decay)
        super().__init__(**kwargs)
        self.accum_iters = accum_iters
        self.accumulator_dtype = accumulator_dtype
        self.decay = decay or None

    def _learning_rate_from_lr(self, lr, learning_rate):
        warnings.warn(
            "`lr` is the Keras 2 spelling of `learning_rate`; pass "
            "`learning_rate` instead.",
            DeprecationWarning,
            stacklevel=4,
        )
        default = (
            inspect.signature(type(self).__init__)
            .parameters["learning_rate"]
            .default
        )
        if learning_rate is not None and learning_rate != default:
            raise ValueError(
                "Pass either `learning_rate` or its Keras 2 alias `lr`, not "
                f"both. Received: learning_rate={learning_rate!r}, lr={lr!r}"
            )
        return lr

    # -- State -------------------------------------------------------------

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        if self.accum_iters == 1:
            return
        self._micro_steps = self._add_local_variable(
            "accum_micro_steps", shape=(), dtype="int"
        )
        self._micro_batches = self._add_local_variable(
            "accum_micro_batches", shape=(), dtype="int"
        )
        self._accumulators = [
            self._add_accumulator(variable) for variable in variables
        ]

    def _add_accumulator(self, variable):
        dtype = self.accumulator_dtype
        if dtype is None:
            dtype = backend.standardize_dtype(variable.dtype)
            if dtype in _LOW_PRECISION_DTYPES:
                dtype = "float32"
        return self._add_local_variable(
            f"{variable.path.replace('/', '_')}_accumulator",
            shape=variable.shape,
            dtype=dtype,
            reference=variable,
        )

    def _add_local_variable(self, name, shape, dtype, reference=None):
        """Adds a replica-local variable (`synchronization="on_read"`).

        Under `tf.distribute`, each replica adds its own gradients into its
        own copy, without communication; `_apply_window` sums the copies
        once per window. Read outside a replica (saving), an
        accumulator is the sum over replicas and a counter the first
        replica's; assigned outside (restoring), an accumulator is split
        evenly. Elsewhere this is a plain variable, laid out like
        `reference`.
        """
        with _backend.colocate_with(self, reference):
            with keras.name_scope(self.name, caller=self):
                variable = keras.Variable(
                    initializer=keras.initializers.Zeros(),
                    shape=shape,
                    dtype=dtype,
                    trainable=False,
                    aggregation=(
                        "only_first_replica" if reference is None else "sum"
                    ),
                    synchronization="on_read",
                    layout=getattr(reference, "_layout", None),
                    name=name,
                )
        self._track_variable(variable)
        return variable

    # -- Introspection -----------------------------------------------------

    @property
    def micro_steps(self):
        """Micro-batches held in the pending window, `0..accum_iters - 1`.

        Always `0` with `accum_iters=1`. `iterations` counts applied updates.
        """
        if self.accum_iters == 1 or not self.built:
            return ops.zeros((), dtype="int32")
        return self._micro_steps.value

    @property
    def micro_batches_seen(self):
        """Micro-batches (`apply` calls) accumulated since creation.

        Micro-steps dropped by a `LossScaleOptimizer` for non-finite
        gradients never reach this optimizer and are not counted.
        """
        if self.accum_iters == 1 or not self.built:
            return self.iterations
        return self._micro_batches.value

    @property
    def last_apply_updated(self):
        """Whether the last `apply` (or `flush`) updated the weights."""
        if self.accum_iters == 1:
            return ops.greater(self.iterations, 0)
        if not self.built:
            return ops.convert_to_tensor(False)
        return ops.logical_and(
            ops.equal(self._micro_steps.value, 0),
            ops.greater(self._micro_batches.value, 0),
        )

    # -- The mechanism -----------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if self.accum_iters == 1:
            return super().apply(grads, trainable_variables)
        if len(grads) == 0:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer "
                    "must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
            self._check_variables_are_known(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"Received {len(grads)} gradients for "
                f"{len(trainable_variables)} variables."
            )
        has_gradient = [g is not None for g in grads]
        with keras.name_scope(self.name, caller=self):
            # counter: one more micro-batch in the window.
            micro_steps = self._micro_steps + 1
            self._micro_steps.assign(micro_steps)
            self._micro_batches.assign(self._micro_batches + 1)
            # update_switch: the window is full.
            update_switch = ops.greater_equal(micro_steps, self.accum_iters)
            # accumulate, or blend and apply on the window's last micro-step.
            _backend.accumulate(
                self,
                [self._accumulator_for(v) for v in trainable_variables],
                grads,
                micro_steps,
                update_switch,
                lambda totals: self._apply_window(
                    totals, has_gradient, trainable_variables
                ),
            )

    def flush(self):
        """Applies the pending partial window, if any, and resets it.

        The update uses the mean of the gradients of the micro-batches the
        window holds (`micro_steps` of them), so a flushed window of `m`
        micro-batches of size `b` equals the parent optimizer on one batch of
        `m * b`. Does nothing when no micro-batch is pending or with
        `accum_iters=1`. Every trainable variable is updated, with the
        accumulated gradient of the window. Call it eagerly (the
        `FlushAccumulation` callback does, at the end of epochs or training).
        """
        if self.accum_iters == 1 or not self.built:
            return
        trainable_variables = self._trainable_variables
        _backend.run_if(
            self,
            ops.greater(self._micro_steps.value, 0),
            lambda: self._apply_window(
                [a.value for a in self._accumulators],
                [True] * len(trainable_variables),
                trainable_variables,
            ),
        )

    def _apply_window(self, totals, has_gradient, variables):
        """Applies the mean of a window's gradients, then starts a new one.

        Args:
            totals: the sum of the window's gradients, one per variable of
                `variables` (on torch: the accumulators themselves, which
                the mean may overwrite).
            has_gradient: one bool per variable: whether the call that
                closes the window had a gradient for it. Variables without
                one get `None`, and the parent optimizer skips them, as it
                would; what the window had summed for them is dropped.
            variables: the trainable variables, in the order of `totals`.

        Under `tf.distribute` the replicas' totals are summed here, once per
        window, so that clipping and the update see the global mean
        gradient, as on one device with the global batch (Keras' own
        optimizers clip each replica's share before summing).

        The divisor is read from the counter variable here, not taken from
        the tensor `apply` computed: captured into TensorFlow's XLA loop,
        that tensor made every accumulating micro-step 0.7 ms slower (MLP,
        RMSprop, `python -m benchmarks.window_steps --xla`).
        """
        micro_steps = self._micro_steps.value
        present = [t for t, has in zip(totals, has_gradient) if has]
        means = iter(
            _backend.window_mean(
                _backend.sum_over_replicas(present), micro_steps
            )
        )
        grads = [
            ops.cast(next(means), variable.dtype) if has else None
            for has, variable in zip(has_gradient, variables)
        ]
        super().apply(grads, variables)
        _backend.end_window(self)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # TensorFlow only (Keras' `TFOptimizer` reduces gradients across
        # replicas here, every `apply`): a window's gradients are already
        # summed over replicas by `_apply_window`.
        if self.accum_iters == 1:
            return super()._all_reduce_sum_gradients(grads_and_vars)
        return grads_and_vars

    def _accumulator_for(self, variable):
        return self._accumulators[self._get_variable_index(variable)]

    # -- Keras 2 time decay ------------------------------------------------

    def _get_current_learning_rate(self):
        learning_rate = super()._get_current_learning_rate()
        if not self.decay:
            return learning_rate
        updates = ops.cast(self._iterations, "float32")
        return ops.divide(
            ops.cast(learning_rate, "float32"),
            ops.add(1.0, ops.multiply(self.decay, updates)),
        )

    # -- Serialization -----------------------------------------------------

    def save_own_variables(self, store):
        if self.accum_iters == 1 or not self.built:
            return super().save_own_variables(store)
        # Between windows TensorFlow and JAX leave the last window's sums in
        # the accumulators (the next micro-step overwrites them); save the
        # empty window they stand for.
        between_windows = int(ops.convert_to_numpy(self._micro_steps)) == 0
        accumulators = {id(a) for a in self._accumulators}
        for i, variable in enumerate(self.variables):
            value = variable.numpy()
            if between_windows and id(variable) in accumulators:
                value = np.zeros_like(value)
            store[str(i)] = value

    def load_own_variables(self, store):
        if self.built and len(store.keys()) != len(self.variables):
            raise ValueError(
                f"Cannot restore the state of optimizer '{self.name}' "
                f"({type(self).__name__}, accum_iters={self.accum_iters}): "
                f"the checkpoint holds {len(store.keys())} optimizer "
                f"variables, this optimizer has {len(self.variables)}. The "
                "checkpoint was saved with a different optimizer or "
                "accumulation configuration (accum_iters, amsgrad, momentum, "
                "centered, use_ema, or a learning-rate schedule instead of a "
                "float); rebuild the optimizer with the saved configuration."
            )
        super().load_own_variables(store)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "accum_iters": self.accum_iters,
                "accumulator_dtype": self.accumulator_dtype,
                "decay": self.decay,
            }
        )
        return config
