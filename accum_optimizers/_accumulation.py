"""The gradient-accumulation mechanism shared by every accumulating optimizer.

Over a window of `accum_iters` consecutive `apply` calls with gradients
g_1..g_k, the optimizer adds each g_i into a per-variable sum and updates
the weights once, on the k-th call, with the mean gradient
(g_1 + ... + g_k) / k, through the parent Keras optimizer's own `apply`:
unscaling, clipping, weight decay, the update math, EMA, constraints and the
`iterations` increment all happen exactly once per window, so `iterations`
counts applied updates, and learning-rate schedules, bias corrections and
EMA see the step numbers of a run with a k times larger batch.

Each call reads

    counter -> update_switch -> accumulate, or add and apply:

    micro_steps += 1
    update_switch = micro_steps >= accum_iters
    if update_switch:                           (once per window)
        parent.apply((sums + grads) / micro_steps)
        micro_steps = 0
    else:                                       (the other micro-steps)
        sums += grads

A call may weigh its micro-batch (`apply(grads, weight=n)`, `n` the
normalizer of the micro-batch's loss): it adds `n * grads` and the window
divides by its total weight, the sum of the `n_j` (a call without a weight
counts 1), so the update is sum(n_j g_j) / sum(n_j), the big batch's own
mean gradient even when micro-batches differ in size, sample weights or
valid tokens.

The `if` is a real branch on every backend, so accumulating micro-steps never
run the update math; how each backend arranges it is in `_backend`. With
`accum_iters=1` the optimizer is the parent optimizer: no extra variables
and the parent's own code path.

A call's arguments are checked before any state changes, so a call that
raises changes nothing. A variable left out of a call counts as a `None`
gradient: every call accumulates over all the variables the optimizer was
built with.
"""

import contextlib
import inspect
import threading
import warnings

import keras
import numpy as np
from keras import backend
from keras import config as keras_config
from keras import ops

from accum_optimizers import _args
from accum_optimizers import _keras_private

# `LossScaleOptimizer` around an accumulating optimizer: `weight=` and
# weights-only resumes (patched once, on import).
from accum_optimizers import _loss_scale  # noqa: F401

# A `MultiOptimizer` of accumulating optimizers: the loss, and one
# finiteness check for all of them (patched once, on import).
from accum_optimizers import _multi_optimizer  # noqa: F401
from accum_optimizers import schedules
from accum_optimizers._backend import BackendAccumulation
from accum_optimizers._finite import all_finite
from accum_optimizers._finite import masked
from accum_optimizers._restore import WINDOW_STATE
from accum_optimizers._restore import Layout
from accum_optimizers._restore import is_empty
from accum_optimizers._restore import lasting_values
from accum_optimizers._restore import plan_restore
from accum_optimizers._restore import saved_samples_seen
from accum_optimizers._validation import LOW_PRECISION_DTYPES
from accum_optimizers._validation import concrete_value
from accum_optimizers._validation import validate_loss
from accum_optimizers._validation import validate_weight

class GradientAccumulation(BackendAccumulation):
    """Mixin that makes a Keras optimizer accumulate gradients.

    Classes are made with `accum_optimizers.accumulating(parent)`, which
    puts this mixin before `parent` in the bases and sets `_accum_parent`.
    See the module docstring for the mechanism.

    Args:
        *args: the parent optimizer's positional arguments, in its order.
    {accumulation_args}
        **kwargs: the parent optimizer's keyword arguments.
    """

    _accum_parent = None

    def __init__(self, *args, **kwargs):
        accumulation = _args.checked(
            {name: kwargs.pop(name) for name in _args.NAMES if name in kwargs}
        )
        accum_iters = accumulation["accum_iters"]
        schedule = (
            accum_iters
            if isinstance(accum_iters, schedules.AccumSchedule)
            else None
        )
        decay = accumulation["decay"]
        arguments = self._accum_parent_arguments(
            args, kwargs, accumulation["lr"]
        )
        steps = arguments.arguments.get("gradient_accumulation_steps")
        if (schedule or accum_iters > 1) and steps:
            raise ValueError(
                "Pass either `accum_iters` or Keras' own "
                "`gradient_accumulation_steps`, not both: together they would "
                "accumulate twice. Received: "
                f"accum_iters={accum_iters}, "
                f"gradient_accumulation_steps={steps!r}"
            )
        if decay is not None:
            warnings.warn(
                "`decay` is the Keras 2 time decay; in Keras 3 pass "
                "`learning_rate=keras.optimizers.schedules.InverseTimeDecay("
                "learning_rate, decay_steps=1, decay_rate=decay)` instead.",
                DeprecationWarning,
                stacklevel=2,
            )
        super().__init__(*arguments.args[1:], **arguments.kwargs)
        self.accum_iters = accum_iters
        self.skip_nonfinite = accumulation["skip_nonfinite"]
        self.accumulator_dtype = accumulation["accumulator_dtype"]
        self.decay = decay

    def _accum_parent_arguments(self, args, kwargs, lr):
        """Binds the parent's arguments, so that what the user passed
        explicitly is known (`lr` with `learning_rate` is refused even when
        `learning_rate` equals its default)."""
        signature = inspect.signature(self._accum_parent.__init__)
        try:
            arguments = signature.bind_partial(None, *args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{type(self).__name__}(): {error}") from None
        explicit = arguments.arguments
        if lr is not None:
            warnings.warn(
                "`lr` is the Keras 2 spelling of `learning_rate`; pass "
                "`learning_rate` instead.",
                DeprecationWarning,
                stacklevel=3,
            )
            if "learning_rate" in explicit:
                raise ValueError(
                    "Pass either `learning_rate` or its Keras 2 alias `lr`, "
                    "not both. Received: "
                    f"learning_rate={explicit['learning_rate']!r}, lr={lr!r}"
                )
            explicit["learning_rate"] = lr
        if explicit.get("epsilon", 0) is None:
            # Keras 2 spelled "Keras' default epsilon" as `epsilon=None`.
            explicit["epsilon"] = keras_config.epsilon()
        return arguments

    # -- State -------------------------------------------------------------

    def build(self, variables):
        if self.built:
            return
        unbuilt = len(self.variables)
        super().build(variables)
        parent = len(self.variables)
        if self._accumulates:
            for state in WINDOW_STATE:
                variable = self._accum_add_variable(
                    f"accum_{state.name}",
                    shape=state.shape(len(variables)),
                    dtype=state.dtype,
                    aggregation=state.aggregation,
                )
                setattr(self, f"_accum_{state.name}", variable)
            self._accum_sums = [
                self._accum_add_sum(variable) for variable in variables
            ]
        self._accum_layout = Layout(unbuilt, parent, len(self.variables))
        pending = self.__dict__.pop("_accum_pending_restore", None)
        if pending is not None:
            with self._accum_outside_compiled_code():
                self._accum_restore(list(pending))

    def _accum_add_sum(self, variable):
        dtype = self.accumulator_dtype
        if dtype is None:
            dtype = backend.standardize_dtype(variable.dtype)
            if dtype in LOW_PRECISION_DTYPES:
                dtype = "float32"
        return self._accum_add_variable(
            f"{variable.path.replace('/', '_')}_accum_sum",
            shape=variable.shape,
            dtype=dtype,
            reference=variable,
        )

    def _accum_add_variable(
        self, name, shape, dtype, reference=None, aggregation=None
    ):
        """Adds a replica-local variable (`synchronization="on_read"`).

        Under `tf.distribute` each replica adds its own gradients into its
        own copy, without communication; the window sums the copies once.
        Read outside a replica (saving), a sum is the total over replicas;
        assigned outside (restoring), it is split evenly. Elsewhere this is
        a plain variable, laid out like `reference`. `aggregation` is
        `"sum"` for sums (with a `reference`); the window's other variables
        declare theirs (`WINDOW_STATE`).
        """
        if aggregation is None:
            aggregation = "sum"
        with self._accum_colocate(reference):
            with keras.name_scope(self.name, caller=self):
                variable = keras.Variable(
                    initializer=keras.initializers.Zeros(),
                    shape=shape,
                    dtype=dtype,
                    trainable=False,
                    aggregation=aggregation,
                    synchronization="on_read",
                    layout=_keras_private.variable_layout(reference),
                    name=name,
                )
        self._track_variable(variable)
        return variable

    # -- Introspection -----------------------------------------------------

    @property
    def accum_iters(self):
        """The window size: an int, a dict `{update: k}`, or an
        `AccumSchedule` (see the class docstring)."""
        return self._accum_iters

    @accum_iters.setter
    def accum_iters(self, accum_iters):
        schedule = schedules.get(accum_iters)
        if isinstance(schedule, schedules.PiecewiseConstantAccumIters):
            accum_iters = dict(schedule.boundaries)
        else:
            accum_iters = schedule
        layout = self.__dict__.get("_accum_layout")
        if layout is not None and not layout.has_window:
            needs_window = not isinstance(accum_iters, int) or accum_iters > 1
            if needs_window:
                raise ValueError(
                    f"Cannot set `accum_iters` of '{self.name}' to "
                    f"{accum_iters!r}: it was built with accum_iters=1, "
                    "without the window's state (its sums and counters). "
                    "Set `accum_iters` before the optimizer is built (before "
                    "the first `fit` or `apply`), or make a new optimizer. "
                    f"Received: accum_iters={accum_iters!r}"
                )
        self._accum_iters = accum_iters

    @property
    def _accumulates(self):
        """Whether the optimizer has a window, decided once, when it is
        built: False for `accum_iters=1` (the parent optimizer unchanged),
        unless the window's state is needed anyway: to skip non-finite
        micro-batches, or to count samples for a learning rate keyed on
        them."""
        layout = self.__dict__.get("_accum_layout")
        if layout is not None:
            return layout.has_window
        return (
            self._accum_schedule is not None
            or self.accum_iters > 1
            or self.skip_nonfinite
            or schedules.keyed_on_samples(self._learning_rate)
        )

    @property
    def _accum_schedule(self):
        """The `AccumSchedule` `accum_iters` stands for, or `None` for a
        constant window size."""
        if isinstance(self.accum_iters, dict):
            return schedules.PiecewiseConstantAccumIters(self.accum_iters)
        if isinstance(self.accum_iters, schedules.AccumSchedule):
            return self.accum_iters
        return None

    def _accum_window_size(self, key=None):
        """`k` for the window that produces the next update: an int, or an
        int32 tensor under a schedule. `key` is what the schedule is
        keyed on, applied updates (or samples seen, for `by_samples`);
        defaults to the optimizer's own count."""
        schedule = self._accum_schedule
        if schedule is None:
            return self.accum_iters
        if key is None:
            key = self._accum_schedule_key(schedule)
        return ops.cast(schedule(key), "int32")

    def _accum_schedule_key(self, schedule):
        """The optimizer's count `schedule` is keyed on: `iterations`, or
        `samples_seen` (float32) for `by_samples`."""
        if not schedules.keyed_on_samples(schedule):
            return self._iterations.value
        return self._accum_samples()

    def _accum_samples(self):
        """`samples_seen` of a built accumulating optimizer (0 before)."""
        if not self.built or not self._accumulates:
            return ops.convert_to_tensor(0.0, "float32")
        return ops.add(
            self._accum_samples_seen.value,
            self._accum_samples_seen_error.value,
        )

    @property
    def current_accum_iters(self):
        """The window size now, as a Python int (`accum_iters`, or the
        schedule's value at the current number of applied updates)."""
        return int(ops.convert_to_numpy(self._accum_window_size()))

    @property
    def micro_steps(self):
        """Micro-batches held in the pending window, `0..accum_iters - 1`.

        Always `0` with `accum_iters=1`. `iterations` counts applied updates.
        """
        if not self._accumulates or not self.built:
            return ops.zeros((), dtype="int32")
        return ops.convert_to_tensor(self._accum_micro_steps)

    @property
    def micro_batches_seen(self):
        """Micro-batches (`apply` calls) accumulated since creation.

        Micro-steps dropped by a `LossScaleOptimizer` for non-finite
        gradients never reach this optimizer and are not counted.
        """
        if not self._accumulates or not self.built:
            return self.iterations
        return ops.convert_to_tensor(self._accum_micro_batches)

    @property
    def skipped_micro_batches(self):
        """Micro-batches left out of their window because their gradients
        were not finite (`skip_nonfinite=True`), since creation."""
        if not self._accumulates or not self.built:
            return ops.zeros((), dtype="int32")
        return ops.convert_to_tensor(self._accum_skipped)

    @property
    def samples_seen(self):
        """The total weight of the applied windows, as a float32 scalar:
        samples (or tokens, or sample weights) when windows are weighted
        (`weigh_micro_batches`, `apply(..., weight=)`), micro-batches
        otherwise. `by_samples` schedules are keyed on it; a pending
        window is not counted until it is applied."""
        if not self._accumulates or not self.built:
            return ops.cast(self.iterations, "float32")
        return self._accum_samples()

    @property
    def window_loss(self):
        """The loss of the last applied window: the mean of its
        micro-batches' losses, weighed as their gradients are, which is the
        big batch's loss at the window's weights. `fit` hands each
        micro-batch's loss to the optimizer; a custom loop passes
        `apply(..., loss=)`. NaN where a micro-batch of the window came
        without its loss; `0` before the first update."""
        if not self._accumulates or not self.built:
            return ops.zeros((), dtype="float32")
        return ops.convert_to_tensor(self._accum_window_loss)

    @property
    def window_grad_norm(self):
        """The global norm of the last applied window's mean gradient (before
        clipping): the big batch's gradient norm. `0` before the first
        update; infinite where the window's weighted sums square past
        float32's range (weights times gradients above about 1e19)."""
        if not self._accumulates or not self.built:
            return ops.zeros((), dtype="float32")
        return ops.convert_to_tensor(self._accum_window_grad_norm)

    @property
    def last_apply_updated(self):
        """Whether the last `apply` (or `flush`) updated the weights."""
        if not self._accumulates:
            return ops.greater(self.iterations, 0)
        if not self.built:
            return ops.convert_to_tensor(False)
        return ops.logical_and(
            ops.equal(self._accum_micro_steps.value, 0),
            ops.greater(self._accum_micro_batches.value, 0),
        )

    # -- The mechanism -----------------------------------------------------

    def apply(self, grads, trainable_variables=None, *, weight=None, loss=None):
        """Adds a micro-batch's gradients to the window; updates the
        weights on the window's last micro-batch.

        Args:
            grads: one gradient (or `None`) per variable.
            trainable_variables: the variables, in the order of `grads`.
                Defaults to the variables the optimizer was built with.
                A variable left out counts as a `None` gradient.
            weight: Optional number or scalar tensor, finite and `> 0`: the
                normalizer of the micro-batch's loss (its sample count, the
                sum of its sample weights, or its count of valid tokens).
                The window then applies sum(weight_j * grads_j) /
                sum(weight_j), the mean gradient of the window's
                concatenated batch. Defaults to `None`, which counts `1`.
                Under `tf.distribute`, pass each replica's own weight (`0`
                for a replica whose share of the micro-batch is empty): the
                weights are summed over replicas with the gradients, once
                per window.
            loss: Optional scalar: the micro-batch's loss (its mean, before
                any loss scaling), for `window_loss`, weighed like the
                gradients. `fit` passes it on its own. Defaults to `None`.
        """
        # What arrived beside the arguments is taken first: a call that
        # raises leaves nothing behind for the next one.
        if loss is None:
            loss = self._accum_take_loss()
        handoff = self._accum_take_handoff()
        loss = validate_loss(loss)
        scaled, check, valid = False, True, None
        checked = contextlib.nullcontext()
        if weight is None and handoff is not None:
            weight = handoff.weight
            scaled, check = handoff.loss_scaled, handoff.check
            if handoff.checked is not None:
                checked = handoff.checked()
            if handoff.may_be_invalid:
                valid = ops.isfinite(ops.cast(weight, "float32"))
        if weight is not None:
            self._accum_check_weighable()
        if weight is not None and check:
            weight, checked = self._accum_checked_weight(weight)
        with checked:
            self._accum_apply(
                grads, trainable_variables, weight, scaled, loss, valid
            )

    def _accum_apply(
        self, grads, trainable_variables, weight, scaled, loss, valid=None
    ):
        """`apply`, its weight checked; `scaled`: the gradients arrive
        multiplied by it (see `scale_loss`); `loss`: the micro-batch's loss
        or `None`; `valid`: `None`, or whether a weight that compiled code
        could not refuse is valid (NaN where not): a micro-batch whose
        weight is not is left out of its window, as a skipped one."""
        if not self._accumulates:
            # A window of one micro-batch: its weight cancels out.
            return super().apply(grads, trainable_variables)
        grads = list(grads)
        if not grads:
            return
        grads = self._accum_gradients_of_every_variable(
            grads, trainable_variables
        )
        overwrite = [
            self._overwrite_variable_with_gradient(v)
            for v in self._trainable_variables
        ]
        summed = [i for i, over in enumerate(overwrite) if not over]

        def micro_step(finite):
            self._accum_take_micro_step(
                grads, summed, overwrite, weight, scaled, loss, finite
            )

        with keras.name_scope(self.name, caller=self):
            finite = self._accum_enters_window(grads, valid)
            if finite is None:
                return micro_step(None)
            known = concrete_value(finite)
            if known is None:
                # In compiled code: a branch where the backend's branches
                # may write variables, else the same ops masked by
                # `finite` (see `_backend`).
                return self._accum_if_finite(finite, micro_step)
            if bool(known):
                return micro_step(None)
            self._accum_skipped.assign(self._accum_skipped + 1)

    def _accum_enters_window(self, grads, valid):
        """Whether the micro-batch enters its window (a bool, or a traced
        scalar bool), or `None` where every micro-batch does: with
        `skip_nonfinite`, whether its gradients are finite on every replica;
        and whether its weight is `valid` (see `_accum_apply`)."""
        finite = None
        if self.skip_nonfinite:
            finite = self._accum_finite_of_threads().pop(
                threading.get_ident(), None
            )
            if finite is None:
                finite = all_finite(grads)
        if valid is not None:
            finite = valid if finite is None else ops.logical_and(finite, valid)
        if finite is None:
            return None
        return self._accum_agree_finite(finite)

    def _accum_take_micro_step(
        self, grads, summed, overwrite, weight, scaled, loss, finite
    ):
        """The state changes of one micro-step, laid out by `_accum_apply`;
        with `finite` (a traced scalar bool) they change nothing but the
        skip count where it is false."""
        has_gradient = [g is not None for g in grads]
        weight_or_1 = 1.0 if weight is None else ops.cast(weight, "float32")
        step = 1 if finite is None else ops.cast(finite, "int32")
        # The gradients to multiply by `weight`, unless `scale_loss`
        # weighed the loss already.
        grads_weight = None if scaled else weight
        if finite is not None:
            grads = [masked(g, finite) for g in grads]
        # counter: one more micro-batch in the window.
        micro_steps = self._accum_micro_steps + step
        new_window = ops.equal(micro_steps, 1)
        # update_switch: the window is full.
        update_switch = ops.greater_equal(
            micro_steps, self._accum_window_size()
        )
        if finite is not None:
            new_window = ops.logical_and(new_window, finite)
            update_switch = ops.logical_and(update_switch, finite)
        # Only the counters wait for the gradients: the predicates above
        # must not, or each gradient would be held until the last one
        # exists.
        with self._accum_after(grads):
            self._accum_total_weight.assign(
                ops.add(
                    self._accum_total_weight.value,
                    masked(weight_or_1, finite),
                )
            )
            self._accum_add_loss(loss, weight_or_1, finite)
            if finite is not None:
                self._accum_skipped.assign(self._accum_skipped + 1 - step)
            self._accum_micro_steps.assign(micro_steps)
            self._accum_micro_batches.assign(self._accum_micro_batches + step)
            self._accum_mark_seen(has_gradient, new_window, finite)
        for i in np.flatnonzero(overwrite):
            self._accum_keep_maximum(self._accum_sums[i], grads[i], finite)
        # accumulate, or add and apply on the window's last micro-step.
        self._accum_micro_step(
            [self._accum_sums[i] for i in summed],
            [grads[i] for i in summed],
            new_window,
            update_switch,
            lambda totals: self._accum_apply_window(
                dict(zip(summed, totals)),
                [i for i, has in enumerate(has_gradient) if has],
            ),
            grads_weight,
        )

    def _accum_add_loss(self, loss, weight, finite):
        """`loss_sum += weight * loss`; NaN for a micro-batch without its
        loss, so that its window reports none; nothing when skipped."""
        if loss is None:
            loss = float("nan")
        weighed = ops.multiply(ops.cast(loss, "float32"), weight)
        self._accum_loss_sum.assign(
            ops.add(self._accum_loss_sum.value, masked(weighed, finite))
        )

    def apply_gradients(self, grads_and_vars, *, weight=None, loss=None):
        """`apply` on `(gradient, variable)` pairs; see `apply` for
        `weight` and `loss`. Returns `iterations`, the number of applied
        updates."""
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight, loss=loss)
        return self._iterations

    def stateless_apply(
        self,
        optimizer_variables,
        grads,
        trainable_variables,
        *,
        weight=None,
        loss=None,
    ):
        """Keras' `stateless_apply` (JAX and torch), with `apply`'s
        `weight` and `loss`."""
        if loss is not None:
            self._accum_losses_of_threads()[threading.get_ident()] = loss
        if weight is not None:
            self._accum_hand_over(weight, check=True)
        try:
            return super().stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
        finally:
            # Left over only if it raised early.
            self._accum_take_handoff()
            self._accum_losses_of_threads().pop(threading.get_ident(), None)

    def _accum_check_weighable(self):
        """Refuses weights when the sums are float16: `weight * grad`
        overflows float16's range (65504) at token counts."""
        if self._accumulates and self.accumulator_dtype == "float16":
            raise ValueError(
                "Weighted windows (`weight=`, `weigh_micro_batches`) need an "
                "accumulator with float32's range: a weighted gradient "
                "overflows float16. Pass accumulator_dtype='bfloat16', "
                "'float32' or None. Received: accumulator_dtype='float16'"
            )

    def _accum_checked_weight(self, weight):
        """`(weight, context)`: `weight` as a Python float (concrete) or a
        float32 tensor (traced), refused unless a finite scalar > 0, and the
        context in which the call's state changes run.

        A concrete value is checked now; a traced one at run time by the
        backend (`_accum_check_traced_weight`), before the state changes
        that run in the context.
        """
        value = concrete_value(weight)
        if value is not None:
            zero_allowed = self._accum_zero_weight_allowed()
            weight = validate_weight(value, weight, zero_allowed)
            return weight, contextlib.nullcontext()
        weight = ops.convert_to_tensor(weight)
        if len(weight.shape) != 0:
            raise ValueError(
                "`weight` must be a scalar. Received: weight with shape "
                f"{tuple(weight.shape)}"
            )
        return self._accum_check_traced_weight(ops.cast(weight, "float32"))

    # -- Weights handed over by `model.fit` ----------------------------------

    def _accum_hand_over(
        self,
        weight,
        loss_scaled=False,
        check=False,
        checked=None,
        may_be_invalid=False,
    ):
        """Sets the weight of this thread's next `apply` (the micro-batch
        whose loss is being computed); see `weigh_micro_batches`."""
        self._accum_check_weighable()
        handoffs = self.__dict__.setdefault("_accum_handoffs", {})
        handoffs[threading.get_ident()] = _Handoff(
            weight, loss_scaled, check, checked, may_be_invalid
        )

    def _accum_take_handoff(self):
        handoffs = self.__dict__.get("_accum_handoffs")
        if not handoffs:
            return None
        return handoffs.pop(threading.get_ident(), None)

    def _accum_note_loss(self, loss):
        """Keeps the loss of this thread's micro-batch for its `apply`
        (`fit` computes the loss, then applies its gradients)."""
        if not self._accumulates or backend.backend() == "jax":
            # On JAX `fit` differentiates the function that computes the
            # loss: its value exists only outside (`_accum_take_loss`).
            return
        if backend.backend() == "torch":
            loss = loss.detach()
        self._accum_losses_of_threads()[threading.get_ident()] = loss

    def _accum_losses_of_threads(self):
        return self.__dict__.setdefault("_accum_losses", {})

    def _accum_finite_of_threads(self):
        """Each thread's finiteness of its micro-batch, where a wrapper
        (`MultiOptimizer`) checked every gradient, not only this
        optimizer's."""
        return self.__dict__.setdefault("_accum_finite", {})

    def _accum_take_loss(self):
        """The loss `_accum_note_loss` kept for this thread, or on JAX the
        one Keras' train step computed; `None` without one."""
        losses = self.__dict__.get("_accum_losses")
        if losses:
            loss = losses.pop(threading.get_ident(), None)
            if loss is not None:
                return loss
        if backend.backend() == "jax" and self._accumulates:
            return _keras_private.jax_train_step_loss()
        return None

    def scale_loss(self, loss):
        # `fit` calls this on the micro-batch's loss before differentiating
        # it: multiplying the loss by the micro-batch's weight weighs its
        # gradients for free, instead of multiplying every gradient.
        self._accum_note_loss(loss)
        loss = super().scale_loss(loss)
        handoffs = self.__dict__.get("_accum_handoffs")
        handoff = handoffs.get(threading.get_ident()) if handoffs else None
        if handoff is None or handoff.loss_scaled or not self._accumulates:
            return loss
        handoff.loss_scaled = True
        return ops.multiply(loss, ops.cast(handoff.weight, loss.dtype))

    def _accum_gradients_of_every_variable(self, grads, trainable_variables):
        """`grads` checked and laid out over every built variable.

        Everything that can make the call fail is checked here, before any
        state changes. A variable not passed gets `None`.
        """
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer "
                    "must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            variables = self._trainable_variables
        else:
            variables = list(trainable_variables)
        if len(grads) != len(variables):
            raise ValueError(
                f"Received {len(grads)} gradients for {len(variables)} "
                "variables; pass one gradient (or `None`) per variable."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
        self._check_variables_are_known(variables)
        laid_out = [None] * len(self._trainable_variables)
        for grad, variable in zip(grads, variables):
            if grad is not None:
                _check_shape(grad, variable)
                laid_out[self._get_variable_index(variable)] = grad
        if all(grad is None for grad in laid_out):
            raise ValueError("No gradients provided for any variable.")
        return laid_out

    def _accum_mark_seen(self, has_gradient, new_window, finite=None):
        """Records which variables received gradient in the window (none,
        for a skipped micro-batch: `finite` false)."""
        mask = ops.convert_to_tensor(np.asarray(has_gradient, "int32"))
        if finite is not None:
            mask = ops.multiply(mask, ops.cast(finite, "int32"))
        seen = self._accum_seen
        seen.assign(ops.where(new_window, mask, ops.maximum(seen.value, mask)))

    def _accum_keep_maximum(self, total, grad, finite=None):
        """float8 scale variables (`overwrite_with_gradient`): the window
        keeps the maximum of its "gradients", as the big batch computes
        (unchanged by a skipped micro-batch: `finite` false)."""
        if grad is None:
            return
        grad = ops.cast(grad, total.dtype)
        new_window = ops.equal(self._accum_micro_steps.value, 1)
        kept = ops.where(new_window, grad, ops.maximum(total.value, grad))
        if finite is not None:
            kept = ops.where(finite, kept, total.value)
        total.assign(kept)

    def flush(self):
        """Applies the pending partial window, if any, and starts a new one.

        The update uses the (weighted, see `apply`) mean of the gradients
        of the micro-batches the window holds (`micro_steps` of them), so a
        flushed window of `m` micro-batches of size `b` equals the parent
        optimizer on one batch of `m * b`. Only variables that are
        trainable now and received gradient in the window are updated. A
        window whose gradients are not all finite (after a `TerminateOnNaN`
        stop, say) is discarded with a warning, leaving the weights as they
        are. Does nothing when no micro-batch is pending or with
        `accum_iters=1`. Call it eagerly (the `FlushAccumulation` callback
        does, at the end of epochs or of training).
        """
        if not self._accumulates or not self.built:
            return
        pending = int(ops.convert_to_numpy(self._accum_micro_steps.value))
        if pending == 0:
            return
        seen = ops.convert_to_numpy(self._accum_seen.value)
        chosen = [
            i
            for i, variable in enumerate(self._trainable_variables)
            if seen[i] and variable.trainable
        ]
        totals = {i: self._accum_sums[i].value for i in chosen}
        finite = self._accum_finite_everywhere(
            all(
                np.isfinite(ops.convert_to_numpy(t)).all()
                for t in totals.values()
            )
        )
        if not finite:
            warnings.warn(
                f"{type(self).__name__}.flush(): the pending window of "
                f"{pending} micro-batches holds non-finite gradients; it was "
                "discarded and the weights were left unchanged.",
                stacklevel=2,
            )
        if not finite or not chosen:
            self._accum_end_window()
            return
        self._accum_apply_window(totals, chosen)

    def _accum_apply_window(self, totals, present):
        """Applies the window's mean gradient, then starts a new window.

        Args:
            totals: `{variable index: the window's sum}` for the summed
                variables (on torch the sums themselves, which the mean may
                overwrite in place).
            present: indices of the variables to update: those with a
                gradient in the call that closes the window (as Keras'
                own accumulation), or the ones `flush` chose. The window's
                sums of the others are dropped.

        Under `tf.distribute` the replicas' sums and weights are added
        here, once per window, so that clipping and the update see the
        global mean gradient, as on one device with the global batch.
        """
        variables = self._trainable_variables
        summed = [i for i in present if i in totals]
        # Read the counts here, inside the branch: under TensorFlow's XLA
        # loop, a tensor captured from outside costs every micro-step.
        total_weight = self._accum_total_weight.value
        # The loss sum crosses replicas with the gradient sums.
        reduced, total_weight = self._accum_reduce_window(
            [totals[i] for i in summed] + [self._accum_loss_sum.value],
            total_weight,
        )
        sums, loss_sum = reduced[:-1], reduced[-1]
        # A window whose micro-batches all weigh 0 (`fit`: every sample
        # weight or token masked) has zero sums: a zero gradient, as the
        # big batch's `divide_no_nan`.
        divisor = ops.where(ops.greater(total_weight, 0.0), total_weight, 1.0)
        self._accum_window_grad_norm.assign(_norm_of_mean(sums, divisor))
        means = self._accum_window_mean(sums, divisor)
        means = self._accum_store_means(
            [self._accum_sums[i] for i in summed], means
        )
        self._accum_window_loss.assign(ops.divide(loss_sum, divisor))
        grads = dict(zip(summed, means))
        for i in present:
            if i not in totals:
                grads[i] = self._accum_sums[i].value  # a window's maximum
        super().apply(
            [ops.cast(grads[i], variables[i].dtype) for i in present],
            [variables[i] for i in present],
        )
        # After the update, whose learning rate is that of the samples
        # seen before the window.
        self._accum_count_samples(total_weight)
        self._accum_end_window()

    def _accum_count_samples(self, weight):
        """`samples_seen += weight`, compensated (Knuth's two-sum): the
        pair's sum stays exact where a float32 total would drop tokens
        once it passes 2**24."""
        total = self._accum_samples_seen.value
        added = ops.add(total, weight)
        kept = ops.subtract(added, total)
        lost = ops.add(
            ops.subtract(total, ops.subtract(added, kept)),
            ops.subtract(weight, kept),
        )
        self._accum_samples_seen.assign(added)
        self._accum_samples_seen_error.assign(
            ops.add(self._accum_samples_seen_error.value, lost)
        )

    def finalize_variable_values(self, var_list):
        # `fit` calls this once, at the end of training.
        if (
            self._accumulates
            and self.built
            and not getattr(self, "_accum_flush_at_train_end", False)
        ):
            try:
                pending = ops.convert_to_numpy(self._accum_micro_steps.value)
            except TypeError:
                # A JAX train step that failed leaves the variables without
                # values; let its own error through.
                pending = 0
            self._accum_report_refused_weights()
            if int(pending):
                warnings.warn(
                    f"Training ended with {pending} micro-batches of a window "
                    f"pending in {type(self).__name__}: they carry into the "
                    "next `fit`, and the weights do not include them yet. To "
                    "apply them as a last, smaller update (as the big-batch "
                    "run's short last batch), add "
                    "`accum_optimizers.FlushAccumulation()` to the callbacks, "
                    "or use a sample count that is a multiple of "
                    "`batch_size * accum_iters`.",
                    stacklevel=2,
                )
        super().finalize_variable_values(var_list)

    def _accum_report_refused_weights(self):
        """Raises, at the end of `fit`, for micro-batches that compiled code
        left out of their windows because `weigh_micro_batches` found their
        loss normalizer negative or not finite (it cannot raise there): with
        `skip_nonfinite=False` nothing else leaves a micro-batch out."""
        if self.skip_nonfinite:
            return
        try:
            skipped = int(ops.convert_to_numpy(self._accum_skipped.value))
        except TypeError:
            return  # A failed JAX step; its own error goes through.
        reported = self.__dict__.get("_accum_refused_reported", 0)
        if skipped > reported:
            self._accum_refused_reported = skipped
            raise ValueError(
                f"weigh_micro_batches(model): {skipped - reported} "
                "micro-batches had a loss normalizer (the sum of their "
                "sample weights) that is negative or not finite; they were "
                "left out of their windows, and the weights did not move for "
                "them. Negative sample weights are not supported. Received: "
                f"skipped_micro_batches={skipped}"
            )

    # -- Keras 2 time decay ------------------------------------------------

    def _get_current_learning_rate(self):
        if schedules.keyed_on_samples(self._learning_rate):
            learning_rate = self._learning_rate.at_samples(
                self._accum_samples()
            )
        else:
            learning_rate = super()._get_current_learning_rate()
        if not self.decay:
            return learning_rate
        updates = ops.cast(self._iterations, "float32")
        return ops.divide(
            ops.cast(learning_rate, "float32"),
            ops.add(1.0, ops.multiply(self.decay, updates)),
        )

    # -- Saving and loading ------------------------------------------------

    def load_own_variables(self, store):
        values = [store[str(i)] for i in range(len(store.keys()))]
        values = [np.array(value) for value in values]
        if not self.built:
            if len(values) == len(self.variables) and not values[0]:
                return super().load_own_variables(store)  # untrained
            # Saved after training, loaded before `build`: keep the values
            # and check and restore them when the optimizer builds.
            self._accum_pending_restore = tuple(values)
            return
        self._accum_restore(values)

    def _accum_restore(self, values):
        accum_iters = self.accum_iters
        if isinstance(accum_iters, schedules.AccumSchedule):
            accum_iters = type(accum_iters).__name__
        describe = (
            f"'{self.name}' ({type(self).__name__}, accum_iters={accum_iters})"
        )
        parent, window = plan_restore(
            values, self._accum_layout, self._accum_saved_window_size, describe
        )
        empty = is_empty(window)
        restored = list(parent)
        if self._accumulates and not empty:
            restored += window
        variables = self.variables
        for index, value in enumerate(restored):
            if tuple(np.shape(value)) != tuple(variables[index].shape):
                raise ValueError(
                    f"Cannot restore the state of optimizer {describe}: "
                    f"saved variable {index} has shape {np.shape(value)}, "
                    f"'{variables[index].path}' has shape "
                    f"{tuple(variables[index].shape)}."
                )
        for variable, value in zip(variables, restored):
            variable.assign(value)
        if self._accumulates and empty:
            self._accum_end_window()
            for name, value in lasting_values(parent, window).items():
                getattr(self, f"_accum_{name}").assign(value)

    def _accum_saved_window_size(self, parent, window):
        """The window size the next update of a planned saved state takes
        (see `plan_restore`)."""
        schedule = self._accum_schedule
        if schedule is None:
            return self.accum_iters
        if schedules.keyed_on_samples(schedule):
            key = np.float32(saved_samples_seen(parent, window))
        else:
            key = int(np.asarray(parent[0]))
        return int(ops.convert_to_numpy(self._accum_window_size(key)))

    def get_config(self):
        config = super().get_config()
        accum_iters = self.accum_iters
        if isinstance(accum_iters, schedules.AccumSchedule):
            accum_iters = keras.saving.serialize_keras_object(accum_iters)
        config.update(
            {name: getattr(self, name) for name in _args.config_names()}
        )
        config["accum_iters"] = accum_iters
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        accum_iters = config.get("accum_iters")
        if isinstance(accum_iters, dict) and "class_name" in accum_iters:
            config = dict(config)
            config["accum_iters"] = keras.saving.deserialize_keras_object(
                accum_iters, custom_objects=custom_objects
            )
        return super().from_config(config, custom_objects=custom_objects)


if GradientAccumulation.__doc__:  # None under `python -OO`
    GradientAccumulation.__doc__ = GradientAccumulation.__doc__.format(
        accumulation_args=_args.docstring("the parent optimizer").replace(
            "\n", "\n    "
        )
    )


class _Handoff:
    """The weight of a thread's next `apply`, set during `fit`'s loss.

    Attributes:
        weight: the micro-batch's weight (a scalar tensor).
        loss_scaled: whether `scale_loss` multiplied the loss by it, so
            the gradients arrive weighed.
        check: whether to refuse a weight that is not finite and `> 0`
            (a user's `weight`; `fit`'s normalizers may be `0`).
        checked: `None`, or a function returning the context in which the
            call's state changes run: that of the caller's own check of the
            weight (`fit`'s normalizers, checked `>= 0` in a TensorFlow
            graph).
        may_be_invalid: whether the weight is NaN where the caller could
            not refuse it (compiled code that cannot raise): the micro-batch
            is then left out of its window.
    """

    def __init__(
        self, weight, loss_scaled, check, checked=None, may_be_invalid=False
    ):
        self.weight = weight
        self.loss_scaled = loss_scaled
        self.check = check
        self.checked = checked
        self.may_be_invalid = may_be_invalid


def _check_shape(grad, variable):
    """Raises unless `grad`'s static shape fits `variable`'s exactly."""
    if hasattr(grad, "dense_shape"):  # tf.IndexedSlices
        shape = getattr(grad.values, "shape", None)
        shape = None if shape is None else shape[1:]
        expected = tuple(variable.shape)[1:]
    else:
        shape = getattr(grad, "shape", None)
        expected = tuple(variable.shape)
    if shape is None:
        return
    try:
        dims = tuple(shape)
    except ValueError:  # a TensorFlow shape of unknown rank
        return
    dims = tuple(None if d is None else int(d) for d in dims)
    fits = len(dims) == len(expected) and all(
        d is None or d == e for d, e in zip(dims, expected)
    )
    if not fits:
        raise ValueError(
            f"The gradient for variable '{variable.path}' has shape "
            f"{dims}, but the variable has shape {expected}; they must be "
            "equal (a gradient is never broadcast)."
        )


def _norm_of_mean(sums, divisor):
    """The norm of the window's mean, `sums / divisor`, from the sums,
    before the means replace them: read after (or from scaled sums), XLA
    keeps every mean beside the sums. Infinite where the squares of the
    sums overflow float32 (weighted sums above about 1e19)."""
    return ops.divide(_global_norm(sums), divisor)


def _global_norm(tensors):
    """The float32 norm of `tensors` taken together."""
    squares = [
        ops.sum(ops.square(ops.cast(tensor, "float32"))) for tensor in tensors
    ]
    if not squares:
        return ops.zeros((), "float32")
    return ops.sqrt(ops.sum(ops.stack(squares)))
