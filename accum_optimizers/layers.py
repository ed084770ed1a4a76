"""`AccumBatchNormalization`: moving statistics pooled over a window.

With gradient accumulation a `BatchNormalization` layer sees micro-batches,
and moves its moving statistics once per micro-batch with that micro-batch's
mean and variance. `AccumBatchNormalization(accum_iters=k)` moves them once
per window of `k` training calls, with the mean and (biased) variance of all
the window's samples together: the moving statistics of a
`BatchNormalization` layer fed the concatenated window as one batch.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from accum_optimizers import _batch_norm_windows
from accum_optimizers import _keras_private
from accum_optimizers._validation import validate_accum_iters


@keras.saving.register_keras_serializable(package="accum_optimizers")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose moving statistics move once per window.

    In training, every call (micro-batch) is normalized with its own mean and
    variance, exactly as `BatchNormalization` does. The moving statistics
    move only on every `accum_iters`-th training call, with the pooled mean
    and biased variance of all the positions the window's calls reduced
    over:

    - `moving_mean = moving_mean * momentum + mean(window) * (1 - momentum)`
    - `moving_var = moving_var * momentum + var(window) * (1 - momentum)`

    These equal the moving statistics of a `BatchNormalization` layer called
    once in training on the window's micro-batches concatenated, also when
    the micro-batches differ in size or in masked positions. The window is
    pooled from each call's count, mean and centered sum of squares (Chan's
    parallel update), which avoids the cancellation of raw sums of squares
    in float32.

    The pending window (count, mean and centered sum of squares per
    channel, and the number of calls) is held in non-trainable variables,
    so it is saved with the layer's weights and a model saved mid-window
    resumes exactly. Inference (`training=False`) is `BatchNormalization`'s.
    With `accum_iters=1` the layer is `BatchNormalization`.

    Use the same `accum_iters` as the accumulating optimizer, so that the
    moving statistics and the weights move on the same calls: an
    accumulating optimizer built on the layer's weights (when `fit` starts)
    warns when they differ, or when its `accum_iters` is a schedule.
    Windows count training calls of this layer, so a model that calls the
    layer more than once per step (a shared layer) needs `accum_iters`
    times that count.

    A window left pending (the end of an epoch) carries into the next one;
    `flush()` moves the statistics with it instead, as a big-batch run
    would with its short last batch.

    With `synchronized=True` under `tf.distribute`, each call's statistics
    are taken over all replicas and its count is summed over them, so the
    window is the global window (as it is under JAX's `DataParallel`). With
    `synchronized=False` each replica pools its own shards, as
    `BatchNormalization` normalizes each replica's shard.

    Args:
        accum_iters: Integer >= 1. Number of training calls per window.
        axis: Integer, the axis that should be normalized (typically the
            features axis).
        momentum: Momentum for the moving average, applied once per window.
        epsilon: Small float added to variance to avoid dividing by zero.
        center: If `True`, add offset of `beta` to normalized tensor.
        scale: If `True`, multiply by `gamma`.
        beta_initializer: Initializer for the beta weight.
        gamma_initializer: Initializer for the gamma weight.
        moving_mean_initializer: Initializer for the moving mean.
        moving_variance_initializer: Initializer for the moving variance.
        beta_regularizer: Optional regularizer for the beta weight.
        gamma_regularizer: Optional regularizer for the gamma weight.
        beta_constraint: Optional constraint for the beta weight.
        gamma_constraint: Optional constraint for the gamma weight.
        synchronized: Only applicable with the TensorFlow backend. If `True`,
            statistics are computed over all replicas.
        renorm: Whether to use Batch Renormalization. Its moving statistics
            (`renorm_mean`, `renorm_stddev`) also move once per window, with
            the window's pooled statistics.
        renorm_clipping: Dictionary with optional keys `"rmax"`, `"rmin"`,
            `"dmax"`, used with `renorm=True`.
        renorm_momentum: Momentum of the renorm statistics, used with
            `renorm=True`.
        **kwargs: Base layer keyword arguments (e.g. `name` and `dtype`).

    Call arguments:
        inputs: Input tensor (of any rank).
        training: Python boolean. `True`: normalize with the call's own
            statistics and add them to the window. `False`: normalize with
            the moving statistics.
        mask: Binary tensor of shape `inputs.shape[:-1]`, `True` where a
            position counts for the statistics. Masked positions count for
            neither the call's nor the window's statistics.
    """

    def __init__(self, accum_iters: int = 1, **kwargs: Any) -> None:
        accum_iters = validate_accum_iters(accum_iters)
        super().__init__(**kwargs)
        self.accum_iters = accum_iters

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        super().build(input_shape)
        shape = (input_shape[self.axis],)

        def state(
            name: str,
            dtype: str = self.variable_dtype,
            shape: tuple[int | None, ...] = shape,
        ) -> keras.Variable:
            return self.add_weight(
                shape=shape,
                name=name,
                dtype=dtype,
                initializer="zeros",
                trainable=False,
                autocast=False,
            )

        # Per channel: positions counted, their mean, and their centered sum
        # of squares; then the training calls made in the pending window.
        self.window_count = state("window_count")
        self.window_mean = state("window_mean")
        self.window_m2 = state("window_m2")
        self.window_calls = state("window_calls", dtype="int32", shape=())
        _batch_norm_windows.BUILT.add(self)

    def call(
        self, inputs: Any, training: bool | None = None, mask: Any = None
    ) -> Any:
        if self.accum_iters == 1 or not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less "
                "than the inputs. Received: "
                f"mask.shape={mask.shape}, inputs.shape={inputs.shape}"
            )
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        gamma = ops.cast(self.gamma, compute_dtype) if self.scale else None
        beta = ops.cast(self.beta, compute_dtype) if self.center else None

        mean, variance = _keras_private.batch_norm_moments(self, inputs, mask)
        if _keras_private.batch_norm_renorm(self):
            r, d, mean, variance = (
                _keras_private.batch_norm_renorm_correction_and_moments(
                    self, mean, variance
                )
            )
            gamma, beta = _keras_private.batch_norm_compose_transforms(
                self, r, d, gamma, beta, compute_dtype
            )
        self._add_to_window(inputs, mask, mean, variance)

        outputs = ops.batch_normalization(
            x=inputs,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _add_to_window(
        self, inputs: Any, mask: Any, mean: Any, variance: Any
    ) -> None:
        """Pools the call's moments into the window; moves at its end."""
        dtype = self.window_mean.dtype
        mean = ops.cast(ops.stop_gradient(mean), dtype)
        variance = ops.cast(ops.stop_gradient(variance), dtype)
        count = self._count(inputs, mask, dtype)

        # Chan et al.'s pairwise update of (count, mean, centered M2).
        old_count = ops.convert_to_tensor(self.window_count)
        old_mean = ops.convert_to_tensor(self.window_mean)
        total = old_count + count
        share = ops.divide_no_nan(count, total)
        delta = mean - old_mean
        new_mean = old_mean + delta * share
        new_m2 = (
            ops.convert_to_tensor(self.window_m2)
            + variance * count
            + ops.square(delta) * old_count * share
        )
        calls = ops.convert_to_tensor(self.window_calls) + 1
        last = ops.greater_equal(calls, self.accum_iters)
        self._store_window(last, total, new_mean, new_m2, calls)

    def _store_window(
        self, close: Any, count: Any, mean: Any, m2: Any, calls: Any
    ) -> None:
        """Stores the window, or moves the statistics and empties it."""
        self._move_statistics(close, mean, ops.divide_no_nan(m2, count))
        zeros = ops.zeros_like(count)
        self.window_count.assign(ops.where(close, zeros, count))
        self.window_mean.assign(ops.where(close, zeros, mean))
        self.window_m2.assign(ops.where(close, zeros, m2))
        self.window_calls.assign(ops.where(close, ops.zeros_like(calls), calls))

    def flush(self) -> None:
        """Moves the statistics with the pending partial window, if any.

        The moving statistics move as those of a `BatchNormalization` layer
        called on the micro-batches the window holds, concatenated (the
        epoch's short last batch of a big-batch run), and the window is
        emptied. Does nothing when no call is pending or with
        `accum_iters=1`. Call it eagerly, where the optimizer's `flush()` is
        called (`FlushAccumulation` does it at the end of epochs).
        """
        if self.accum_iters == 1 or not self.built:
            return
        calls = ops.convert_to_tensor(self.window_calls)
        self._store_window(
            ops.greater(calls, 0),
            ops.convert_to_tensor(self.window_count),
            ops.convert_to_tensor(self.window_mean),
            ops.convert_to_tensor(self.window_m2),
            calls,
        )

    def _move_statistics(self, last: Any, mean: Any, variance: Any) -> None:
        """BatchNormalization's update with `mean, variance` where `last`."""
        if _keras_private.batch_norm_renorm(self):
            # Keras' renorm update, kept only on the window's last call.
            names = [
                "moving_mean",
                "moving_variance",
                "moving_stddev",
                "renorm_mean",
                "renorm_stddev",
            ]
            variables = [getattr(self, name) for name in names]
            # A copy: on torch a variable's tensor is updated in place.
            before = [ops.copy(v) for v in variables]
            _keras_private.batch_norm_update_renorm_statistics(
                self, mean, variance
            )
            for variable, old in zip(variables, before):
                moved = ops.convert_to_tensor(variable)
                variable.assign(ops.where(last, moved, old))
            return
        moving_mean = ops.convert_to_tensor(self.moving_mean)
        moving_variance = ops.convert_to_tensor(self.moving_variance)
        self.moving_mean.assign(
            ops.where(
                last,
                moving_mean * self.momentum + mean * (1.0 - self.momentum),
                moving_mean,
            )
        )
        self.moving_variance.assign(
            ops.where(
                last,
                moving_variance * self.momentum
                + variance * (1.0 - self.momentum),
                moving_variance,
            )
        )

    def _count(self, inputs: Any, mask: Any, dtype: str) -> Any:
        """Positions each channel's statistics were taken over."""
        if mask is None:
            shape = ops.shape(inputs)
            count = ops.ones((), dtype)
            for axis in _keras_private.batch_norm_reduction_axes(self):
                count = count * ops.cast(shape[axis], dtype)
            count = ops.broadcast_to(count, (inputs.shape[self.axis],))
            if self.synchronized:
                count = _sum_over_replicas(count)
            return count
        # The broadcast of Keras' moments for masks (`batch_norm_moments`).
        weights = ops.broadcast_to(ops.expand_dims(mask, -1), ops.shape(inputs))
        weights = ops.cast(ops.cast(weights, "bool"), dtype)
        axes = _keras_private.batch_norm_reduction_axes(self)
        return ops.sum(weights, axis=axes)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "accum_iters": self.accum_iters}


def _sum_over_replicas(value: Any) -> Any:
    """Sums over `tf.distribute` replicas, as synchronized moments do."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


_SWAPPABLE = (keras.layers.BatchNormalization, AccumBatchNormalization)


def with_accum_batch_norm(model: keras.Model, accum_iters: int) -> keras.Model:
    """Clones a model with its `BatchNormalization` layers accumulating.

    Every `BatchNormalization` layer (nested Sequential and Functional
    models included) becomes an `AccumBatchNormalization` with the same
    configuration and `accum_iters`; every other layer is cloned as is. All
    weights are copied, moving statistics included; the new layers start
    with an empty window. The clone is not compiled. Other subclasses of
    `BatchNormalization`, and a `BatchNormalization` inside a layer of your
    own (a `keras.layers.Layer` subclass, which makes its sublayers
    itself), are refused with a `ValueError`: make such a layer create
    `AccumBatchNormalization` itself.

    Args:
        model: A Sequential or Functional `keras.Model`.
        accum_iters: Integer >= 1, the `accum_iters` of the optimizer.

    Returns:
        A new `keras.Model`.

    Raises:
        ValueError: if `accum_iters` is not an integer >= 1, a layer to
            swap is a subclass of `BatchNormalization` or sits inside a
            layer of your own, or a layer was not built in the clone.
    """
    accum_iters = validate_accum_iters(accum_iters)
    pairs = []

    def swap(layer: keras.layers.Layer) -> keras.layers.Layer:
        config = layer.get_config()
        if type(layer) in _SWAPPABLE:
            config["accum_iters"] = accum_iters
            new = AccumBatchNormalization.from_config(config)
        elif isinstance(layer, keras.layers.BatchNormalization):
            # Swapping would drop what the subclass adds; keeping it would
            # leave its statistics per micro-batch. Neither silently.
            raise ValueError(
                f"Cannot swap layer {layer.name!r} of class "
                f"{type(layer).__name__}, a subclass of BatchNormalization, "
                "for AccumBatchNormalization."
            )
        else:
            new = layer.__class__.from_config(config)
        pairs.append((layer, new))
        return new

    clone = keras.models.clone_model(model, clone_function=swap, recursive=True)
    for layer in _keras_private.sublayers(clone):
        # A layer of your own is cloned from its config, and makes its
        # sublayers itself: one holding a BatchNormalization cannot be
        # swapped from outside, and is not left per micro-batch silently.
        if isinstance(layer, keras.layers.BatchNormalization) and not (
            isinstance(layer, AccumBatchNormalization)
        ):
            owner = _owner_of(clone, layer)
            raise ValueError(
                f"Cannot swap layer {layer.name!r} ({type(layer).__name__}) "
                f"inside layer {owner.name!r} of class "
                f"{type(owner).__name__}, a layer of your own: "
                "with_accum_batch_norm swaps the layers of Sequential and "
                "Functional models only. Make it create "
                "`AccumBatchNormalization(accum_iters=...)` itself."
            )
    for old, new in pairs:
        _copy_weights(old, new)
    return clone


def _owner_of(
    model: keras.Model, layer: keras.layers.Layer
) -> keras.layers.Layer:
    """The layer of `model` (nested models looked into) holding `layer`."""
    for candidate in _keras_private.sublayers(model):
        if isinstance(candidate, keras.Model):
            continue
        if any(inner is layer for inner in _keras_private.sublayers(candidate)):
            return candidate
    return model


def _copy_weights(old: keras.layers.Layer, new: keras.layers.Layer) -> None:
    if not old.built:
        return
    if not new.built:
        raise ValueError(
            f"Could not copy the weights of layer {old.name!r}: its clone "
            "was not built. Clone a model that has an `Input`."
        )
    if not isinstance(new, AccumBatchNormalization):
        new.set_weights(old.get_weights())
        return
    window = {
        new.window_count.name,
        new.window_mean.name,
        new.window_m2.name,
        new.window_calls.name,
    }
    targets = {v.name: v for v in new.weights if v.name not in window}
    for variable in old.weights:
        if variable.name in targets:
            targets.pop(variable.name).assign(variable)
    if targets:
        raise ValueError(
            f"Could not copy the weights {sorted(targets)} of layer "
            f"{old.name!r}."
        )
