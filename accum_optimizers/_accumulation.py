"""The accumulating optimizer: a Keras optimizer whose `apply` adds each
micro-batch's gradients into a window and updates the weights once per
window, with the window's mean gradient, through the parent's own `apply`.

A micro-step is one value and one commit:

    step = transition.micro_step(window, grads, ...)      (keras.ops)
    backend.commit(window, step, grads, close)            (the writes)

`transition.micro_step` computes every new value of the window
(`_window/transition.py`: the features are its terms); the backend's
`commit` writes them and, on the window's last micro-step, runs the close
(`_window/close.py`), which calls the parent's `apply` once with the mean.
A call's inputs are checked before anything is written, so a call that
raises changes nothing. With `accum_iters=1` the optimizer is the parent
optimizer: no extra variables and the parent's own code path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Iterable
from typing import Sequence

import keras
from keras import ops

from accum_optimizers import _args
from accum_optimizers import _backend
from accum_optimizers import _fit_scope
from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers import schedules
from accum_optimizers._autograph import unconverted
from accum_optimizers._batch_norm_windows import warn_of_other_windows
from accum_optimizers._parent_args import bind_parent_arguments
from accum_optimizers._window import adascale
from accum_optimizers._window import close
from accum_optimizers._window import counts
from accum_optimizers._window import noise
from accum_optimizers._window import restore
from accum_optimizers._window import step
from accum_optimizers._window import transition
from accum_optimizers._window.spec import Layout
from accum_optimizers._window.spec import build_window
from accum_optimizers._window.spec import window_state


class _ParentClass:
    """`parent_class`, read on the class or an instance: the class that
    `accumulating` gave (`_parent`). A descriptor, so that documentation
    tools reading the classes do not follow it into Keras."""

    def __get__(
        self, optimizer: object, owner: type
    ) -> type[keras.optimizers.Optimizer] | None:
        return getattr(owner, "_parent", None)


if TYPE_CHECKING:
    # To a type checker the mixin is the Keras optimizer it comes before.
    from keras.optimizers import Optimizer as _Optimizer
else:
    _Optimizer = object


class GradientAccumulation(_Optimizer):
    """Mixin that makes a Keras optimizer accumulate gradients.

    Classes are made with `accum_optimizers.accumulating(parent)`, which
    puts this class before `parent` in the bases and sets `parent_class`.

    Args:
        *args: the parent optimizer's positional arguments, in its order.
    {accumulation_args}
        **kwargs: the parent optimizer's keyword arguments.

    Attributes:
        parent_class: the Keras optimizer class the class accumulates for
            (`keras.optimizers.Adam` for `AdamAccumulate`): its update is
            the one applied once per window.
        flush_at_train_end: Boolean. Whether something flushes the pending
            window when training ends; `fit`'s end then leaves the window
            to it instead of warning that one is pending.
            `FlushAccumulation(at_train_end=True)` sets it for the length
            of `fit`, as `EarlyStopping` sets `model.stop_training`: it
            reads `False` once that `fit` has ended, by an exception too.
            Defaults to `False`.
    """

    parent_class = _ParentClass()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        accumulation = _args.checked(
            {name: kwargs.pop(name) for name in _args.NAMES if name in kwargs}
        )
        arguments = bind_parent_arguments(
            type(self), args, kwargs, accumulation
        )
        super().__init__(*arguments.args[1:], **arguments.kwargs)
        self.measure_noise_scale = accumulation["measure_noise_scale"]
        self.noise_scale_momentum = accumulation["noise_scale_momentum"]
        self.accum_iters = accumulation["accum_iters"]
        self.skip_nonfinite = accumulation["skip_nonfinite"]
        self.accumulator_dtype = accumulation["accumulator_dtype"]
        self.jit_compile = accumulation["jit_compile"]
        self.decay = accumulation["decay"]
        adascale.check(self)
        self._window_backend = _backend.WindowBackend(self)
        self._window = None
        # Whether a micro-batch has carried a weight: windows then count
        # samples (a Python fact, known when a compiled step is traced).
        self._counts_weights = False
        # Refused micro-batches the end of a `fit` has reported.
        self._refused_reported = 0
        # `{variable index: traced bool}` while a close updates variables
        # under their seen bit (`_apply_window_mean`).
        self._update_masks: dict[int, Any] = {}

    @unconverted
    def build(self, variables: Sequence[keras.Variable]) -> None:
        if self.built:
            return
        # On TensorFlow, a `LossScaleOptimizer` around a `MultiOptimizer`
        # sets nothing on the inner optimizers: it meets them here.
        _meet_wrappers(building=True)
        unbuilt = len(self.variables)
        super().build(variables)
        parent = len(self.variables)
        state = window_state(self.measure_noise_scale, adascale.follows(self))
        if self._has_window:
            self._window = build_window(self, variables, state)
        self._accum_layout = Layout(unbuilt, parent, len(self.variables), state)
        warn_of_other_windows(self, variables)
        pending = self.__dict__.pop("_accum_pending_restore", None)
        if pending is not None:
            with _backend.outside_compiled_code():
                restore.restore(self, list(pending))

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # Keras' wrappers set it as they take an inner optimizer (to the
        # value it may already hold, which TensorFlow's tracking then does
        # not store): where they meet an accumulating one, that wrapper
        # instance cooperates with it.
        if name == "loss_scale_factor":
            _meet_wrappers()

    @property
    def flush_at_train_end(self) -> bool:
        """Whether something flushes the pending window when training
        ends (see the class docstring)."""
        return _fit_scope.read(self)

    @flush_at_train_end.setter
    def flush_at_train_end(self, value: bool) -> None:
        _fit_scope.set_by_hand(self, value)

    @property
    def _accum_schedule(self) -> schedules.AccumSchedule | None:
        return counts.schedule_of(self.accum_iters)

    @property
    def _has_window(self) -> bool:
        """Whether the optimizer keeps a window (decided when it is built):
        for `accum_iters > 1`, to skip, to measure, to count samples or
        the base steps of a learning rate that follows the window."""
        layout = self.__dict__.get("_accum_layout")
        if layout is not None:
            return layout.has_window
        return (
            self._accum_schedule is not None
            or self.accum_iters > 1
            or self.skip_nonfinite
            or self.measure_noise_scale
            or schedules.keyed_on_samples(
                _keras_private.learning_rate_as_given(self)
            )
            or adascale.follows(self)
        )

    @unconverted
    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[keras.Variable] | None = None,
        *,
        weight: Any = None,
        loss: Any = None,
    ) -> None:
        """Adds a micro-batch's gradients to the window; updates the
        weights on the window's last micro-batch.

        Args:
            grads: one gradient (or `None`) per variable.
            trainable_variables: the variables, in the order of `grads`.
                Defaults to those the optimizer was built with; one left
                out counts as a `None` gradient.
            weight: Optional number or scalar tensor, finite and `> 0`: the
                normalizer of the micro-batch's loss (its sample count, the
                sum of its sample weights, its valid tokens). The window
                applies sum(weight_j * grads_j) / sum(weight_j), the mean
                gradient of its concatenated batch. `None` counts `1`.
                Under `tf.distribute`, each replica's own weight (`0` for
                an empty share).
            loss: Optional scalar: the micro-batch's loss (its mean, before
                loss scaling), for `window_loss`; `fit` passes it itself.

        Raises:
            ValueError: a `weight` or `loss` that cannot be taken, not one
                gradient per variable, a gradient whose shape is not its
                variable's, or no gradient at all; the call then changes
                nothing.
        """
        if self._has_window:
            self._window_backend.begin()
        # What arrived beside the arguments is taken first: a call that
        # raises leaves nothing behind for the next one.
        micro_batch, checked = step.checked_inputs(
            self, _inputs.take(self), weight, loss
        )
        with checked:
            if not self._has_window:
                # A window of one micro-batch: its weight cancels out.
                return super().apply(grads, trainable_variables)
            grads = list(grads)
            if grads:
                grads = step.laid_out(self, grads, trainable_variables)
                with keras.name_scope(self.name, caller=self):
                    self._micro_step(grads, micro_batch)

    def _micro_step(self, grads: Sequence[Any], micro_batch: Any) -> None:
        """One micro-batch into the window: its new values computed, then
        committed, with the close on the window's last micro-step."""
        backend = self._window_backend
        check_finite = self.skip_nonfinite and micro_batch.finite is None
        squares, finite = backend.read_gradients(
            grads, self.measure_noise_scale, check_finite
        )
        if self.skip_nonfinite and micro_batch.finite is not None:
            finite = micro_batch.finite
        enters = transition.enters(finite, micro_batch.valid)
        if enters is not None:
            enters = backend.agree(enters)
        if micro_batch.refused is not None:
            # Refused on any replica: every replica counts it so.
            micro_batch.refused = ops.logical_not(
                backend.agree(ops.logical_not(micro_batch.refused))
            )
        new = transition.micro_step(
            self._window,
            grads,
            micro_batch,
            enters,
            counts.window_size(self),
            squares,
            _backend.replica_count(self),
        )
        with step.noting_partial_writes(self):
            backend.commit(
                self._window,
                new,
                grads,
                lambda: close.close_window(self, new.present),
            )

    def _apply_window_mean(
        self,
        grads: Sequence[Any],
        variables: Sequence[keras.Variable],
        masks: dict[int, Any],
    ) -> None:
        """The parent's update with the window's mean; a variable whose
        index is in `masks` is updated only where its traced bool is true
        (`update_step`)."""
        self._update_masks = masks
        try:
            super().apply(grads, variables)
        finally:
            self._update_masks = {}

    def update_step(
        self, gradient: Any, variable: keras.Variable, learning_rate: Any
    ) -> None:
        mask = self._update_mask(variable)
        parent_update_step = super().update_step
        if mask is None:
            return parent_update_step(gradient, variable, learning_rate)

        def update() -> None:
            # Its weight decay too, which `_apply_weight_decay` left out:
            # Keras' own would `merge_call` inside this branch under
            # tf.distribute.
            _keras_private.decay_weight(self, variable)
            parent_update_step(gradient, variable, learning_rate)

        self._window_backend.run_if(mask, update)

    def _apply_weight_decay(self, variables: list[keras.Variable]) -> None:
        if self._update_masks:
            # Variables updated under a mask decay in their `update_step`.
            variables = [v for v in variables if self._update_mask(v) is None]
        super()._apply_weight_decay(variables)

    def _update_mask(self, variable: keras.Variable) -> Any:
        if not self._update_masks:
            return None
        index = _keras_private.variable_index(self, variable)
        return self._update_masks.get(index)

    def _all_reduce_sum_gradients(
        self, grads_and_vars: list[tuple[Any, keras.Variable]]
    ) -> list[tuple[Any, keras.Variable]]:
        # Keras' TensorFlow optimizer all-reduces every `apply`'s gradients
        # here; a window's sums are all-reduced once, by its close.
        if not self._has_window:
            return super()._all_reduce_sum_gradients(grads_and_vars)
        return grads_and_vars

    @unconverted
    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, keras.Variable]],
        *,
        weight: Any = None,
        loss: Any = None,
    ) -> keras.Variable:
        """`apply` on `(gradient, variable)` pairs.

        Args:
            grads_and_vars: `(gradient, variable)` pairs.
            weight: the micro-batch's weight, as `apply` takes it.
            loss: the micro-batch's loss, as `apply` takes it.

        Returns:
            `iterations`, the number of applied updates.
        """
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight, loss=loss)
        return _keras_private.iterations_variable(self)

    @unconverted
    def stateless_apply(
        self,
        optimizer_variables: Sequence[Any],
        grads: Sequence[Any],
        trainable_variables: Sequence[Any],
        *,
        weight: Any = None,
        loss: Any = None,
    ) -> tuple[list[Any], list[Any]]:
        """Keras' `stateless_apply` (JAX and torch), with `apply`'s
        `weight` and `loss`.

        Args:
            optimizer_variables: the values of the optimizer's variables.
            grads: one gradient (or `None`) per trainable variable.
            trainable_variables: the values of the trainable variables.
            weight: the micro-batch's weight, as `apply` takes it.
            loss: the micro-batch's loss, as `apply` takes it.

        Returns:
            `(trainable_variables, optimizer_variables)`: their new values.
        """
        if loss is not None:
            _inputs.put_loss(self, loss)
        if weight is not None:
            _inputs.hand_over(self, _inputs.Handoff(weight, check=True))
        try:
            return super().stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
        finally:
            _inputs.discard(self)  # left over only if it raised early

    @unconverted
    def flush(self) -> None:
        """Applies the pending partial window, if any, and starts a new one.

        A flushed window of `m` micro-batches of size `b` equals the parent
        optimizer on one batch of `m * b` (weighted as in `apply`); it
        updates the variables trainable now that received gradient in it.
        A window whose gradients are not all finite is discarded with a
        warning, the weights left as they are. Call it eagerly (as the
        `FlushAccumulation` callback does).
        """
        close.flush(self)

    @unconverted
    def scale_loss(self, loss: Any) -> Any:
        # `fit` calls this on the micro-batch's loss before differentiating
        # it: multiplying the loss by the micro-batch's weight weighs its
        # gradients for free, instead of multiplying every gradient.
        step.note_loss(self, loss)
        return step.weighed_loss(self, super().scale_loss(loss))

    def _get_current_learning_rate(self) -> Any:
        given = _keras_private.learning_rate_as_given(self)
        if adascale.follows(self):
            learning_rate = adascale.learning_rate(self)
        elif schedules.keyed_on_samples(given):
            learning_rate = given.at_samples(counts.samples(self))
        else:
            learning_rate = super()._get_current_learning_rate()
        if not self.decay:
            return learning_rate
        # Keras 2's time decay.
        updates = ops.cast(_keras_private.iterations_variable(self), "float32")
        return ops.divide(
            ops.cast(learning_rate, "float32"),
            ops.add(1.0, ops.multiply(self.decay, updates)),
        )

    @unconverted
    def finalize_variable_values(
        self, var_list: Sequence[keras.Variable]
    ) -> None:
        # `fit` calls this once, at the end of training. The flag is this
        # `fit`'s alone, also where the check below raises.
        flushed = self.flush_at_train_end
        _fit_scope.clear(self)
        if self._has_window and self.built:
            close.check_end_of_fit(self, flushed)
        super().finalize_variable_values(var_list)

    def load_own_variables(self, store: dict[str, Any]) -> None:
        restore.load_own_variables(self, store, super().load_own_variables)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), **_args.config_of(self)}

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        custom_objects: dict[str, Any] | None = None,
    ) -> keras.optimizers.Optimizer:
        config = _args.loaded_config(cls, config, custom_objects)
        return super().from_config(config, custom_objects=custom_objects)

    @property
    def current_accum_iters(self) -> int:
        """The window size now, as a Python int (`accum_iters`, or the
        schedule's value at the current number of applied updates)."""
        return int(ops.convert_to_numpy(counts.window_size(self)))

    @property
    def micro_steps(self) -> Any:
        """Micro-batches held in the pending window, `0..accum_iters - 1`
        (`iterations` counts applied updates)."""
        return counts.read(self, lambda w: w.micro_steps, _zero_int)

    @property
    def micro_batches_seen(self) -> Any:
        """Micro-batches (`apply` calls) accumulated since creation (not
        those a `LossScaleOptimizer` drops before they reach it)."""
        return counts.read(self, lambda w: w.micro_batches, self._updates)

    @property
    def skipped_micro_batches(self) -> Any:
        """Micro-batches left out of their window because their gradients
        were not finite (`skip_nonfinite=True`), since creation."""
        return counts.read(self, lambda w: w.skipped, _zero_int)

    @property
    def refused_micro_batches(self) -> Any:
        """Micro-batches left out of their window because compiled code
        refused their loss normalizer (`weigh_micro_batches`: negative, or
        not finite without `skip_nonfinite`), since creation; the end of
        `fit` raises for them."""
        return counts.read(self, lambda w: w.refused, _zero_int)

    @property
    def samples_seen(self) -> Any:
        """The total weight of the applied windows (float32): samples,
        tokens or sample weights when windows are weighted, micro-batches
        otherwise; `by_samples` schedules are keyed on it."""
        if not self._has_window or not self.built:
            return ops.cast(self.iterations, "float32")
        return counts.samples(self)

    @property
    def window_loss(self) -> Any:
        """The last applied window's loss: its micro-batches' losses
        weighed as their gradients are, the big batch's loss (a custom
        loop passes `apply(..., loss=)`). NaN where a micro-batch came
        without its loss; `0` before the first update."""
        return counts.read(self, lambda w: w.window_loss, _zero_float)

    @property
    def window_grad_norm(self) -> Any:
        """The norm of the last applied window's mean gradient (before
        clipping), the big batch's; `0` before the first update, infinite
        where its weighted sums square past float32's range."""
        return counts.read(self, lambda w: w.window_grad_norm, _zero_float)

    @property
    def last_apply_updated(self) -> Any:
        """Whether the last `apply` (or `flush`) updated the weights."""
        return counts.last_apply_updated(self)

    @property
    def noise_scale(self) -> Any:
        """The gradient noise scale `B_simple = tr(Sigma) / |G|^2`: the
        ratio of the moving averages of the windows' estimates, in the unit
        of the window's weight. Infinite where the average `|G|^2` is not
        positive; NaN before the first window of two or more micro-batches,
        and without `measure_noise_scale=True`."""
        return noise.read(self, "noise_scale")

    @property
    def gradient_sq_norm(self) -> Any:
        """The moving average of the windows' unbiased estimates of
        `|G|^2`, the true gradient's squared norm (NaN before the first
        estimate, and where not measured)."""
        return noise.read(self, "gradient_sq_norm")

    @property
    def gradient_noise_trace(self) -> Any:
        """The moving average of the windows' unbiased estimates of
        `tr(Sigma)`, the trace of the per-sample (per unit of weight)
        gradient covariance (NaN before the first estimate, and where not
        measured)."""
        return noise.read(self, "gradient_noise_trace")

    @property
    def window_gradient_sq_norm(self) -> Any:
        """The last applied window's unbiased estimate of `|G|^2`: NaN for
        a window of one micro-batch, `0` before the first update."""
        return noise.read(self, "window_gradient_sq_norm")

    @property
    def window_noise_trace(self) -> Any:
        """The last applied window's unbiased estimate of `tr(Sigma)`: NaN
        for a window of one micro-batch, `0` before the first update."""
        return noise.read(self, "window_noise_trace")

    @property
    def adascale_gain(self) -> Any:
        """AdaScale's gain `r` of the last update (`schedules.adascale`):
        in `[1, S]` for a window `S` times the base batch; NaN without an
        AdaScale learning rate, `0` before the first update."""
        return adascale.read(self, "adascale_gain")

    @property
    def window_scale(self) -> Any:
        """A scaling rule's `S` of the last update (`schedules.
        linear_scaling`, `sqrt_scaling`): its window's weight over
        `base_batch_size`, the base steps it stood for; NaN without such a
        learning rate, `0` before the first update."""
        return adascale.read(self, "window_scale")

    @property
    def scale_invariant_step(self) -> Any:
        """The scale-invariant step of a learning rate that follows the
        window: the base schedule's progress, the base steps the updates
        applied stood for (the sum of AdaScale's gains, or of a scaling
        rule's `S`); NaN without such a learning rate."""
        return adascale.read(self, "scale_invariant_step")

    def _updates(self) -> Any:
        return self.iterations


def _zero_int() -> Any:
    return ops.zeros((), dtype="int32")


def _zero_float() -> Any:
    return ops.zeros((), dtype="float32")


if GradientAccumulation.__doc__:  # None under `python -OO`
    GradientAccumulation.__doc__ = GradientAccumulation.__doc__.format(
        accumulation_args=_args.docstring("the parent optimizer").replace(
            "\n", "\n    "
        )
    )


def _meet_wrappers(building: bool = False) -> None:
    """Has the Keras wrappers taking the calling optimizer cooperate with
    it (`_wrappers.meet_wrappers`)."""
    from accum_optimizers import _wrappers

    _wrappers.meet_wrappers(building)


# Every accumulation argument, an attribute checked when set.
_args.add_attributes(GradientAccumulation)
