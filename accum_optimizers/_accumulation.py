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

import keras
from keras import backend
from keras import ops

from accum_optimizers import _args
from accum_optimizers import _inputs
from accum_optimizers import _keras_private
from accum_optimizers import schedules
from accum_optimizers._backend import BackendAccumulation
from accum_optimizers._batch_norm_windows import warn_of_other_windows
from accum_optimizers._parent_args import bind_parent_arguments
from accum_optimizers._validation import LOW_PRECISION_DTYPES
from accum_optimizers._window.close import WindowClose
from accum_optimizers._window.counts import WindowCounts
from accum_optimizers._window.noise import WindowNoise
from accum_optimizers._window.restore import WindowRestore
from accum_optimizers._window.spec import Layout
from accum_optimizers._window.spec import window_state
from accum_optimizers._window.step import WindowStep


class _ParentClass:
    """`parent_class`, read on the class or an instance: the class that
    `accumulating` gave (`_parent`). A descriptor rather than the class
    itself, so that documentation tools reading the classes do not follow
    it into Keras."""

    def __get__(self, optimizer, owner):
        return getattr(owner, "_parent", None)


class GradientAccumulation(
    WindowStep,
    WindowClose,
    WindowCounts,
    WindowNoise,
    WindowRestore,
    BackendAccumulation,
):
    """Mixin that makes a Keras optimizer accumulate gradients.

    Classes are made with `accum_optimizers.accumulating(parent)`, which
    puts this mixin before `parent` in the bases and sets `parent_class`.
    See the module docstring for the mechanism; the window's parts are in
    `_window/` (its declared state, a micro-step, its close, its counts,
    its saving) and each backend's arrangement in `_backend/`.

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
            of `fit`, as `EarlyStopping` sets `model.stop_training`.
            Defaults to `False`.
    """

    parent_class = _ParentClass()
    flush_at_train_end = False

    def __init__(self, *args, **kwargs):
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
        self.decay = accumulation["decay"]
        # Whether a micro-batch has carried a weight (`_window/step.py`).
        self._accum_counts_weights = False

    # -- State -------------------------------------------------------------

    def build(self, variables):
        if self.built:
            return
        unbuilt = len(self.variables)
        super().build(variables)
        parent = len(self.variables)
        state_declared = window_state(self.measure_noise_scale)
        if self._has_window:
            for state in state_declared:
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
        self._accum_layout = Layout(
            unbuilt, parent, len(self.variables), state_declared
        )
        warn_of_other_windows(self, variables)
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
        if schedules.keyed_on_noise_scale(accum_iters) and not getattr(
            self, "measure_noise_scale", True
        ):
            raise ValueError(
                "`accum_iters=by_noise_scale(...)` follows the measured "
                "noise scale: pass `measure_noise_scale=True` too. Received: "
                f"accum_iters={accum_iters!r}, measure_noise_scale=False"
            )
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
    def measure_noise_scale(self):
        """Whether the optimizer measures the gradient noise scale (see
        `noise_scale`)."""
        return self._accum_measure_noise_scale

    @measure_noise_scale.setter
    def measure_noise_scale(self, measure):
        layout = self.__dict__.get("_accum_layout")
        carries = layout is not None and any(
            variable.noise_scale for variable in layout.state
        )
        if measure and layout is not None and not carries:
            raise ValueError(
                f"Cannot set `measure_noise_scale` of '{self.name}' to True: "
                "it was built without the measurement's variables. Pass "
                "`measure_noise_scale=True` when making the optimizer. "
                f"Received: measure_noise_scale={measure!r}"
            )
        self._accum_measure_noise_scale = measure

    @property
    def _has_window(self):
        """Whether the optimizer has a window, decided once, when it is
        built: False for `accum_iters=1` (the parent optimizer unchanged),
        unless the window's state is needed anyway: to skip non-finite
        micro-batches, to measure the noise scale, or to count samples for
        a learning rate keyed on them."""
        layout = self.__dict__.get("_accum_layout")
        if layout is not None:
            return layout.has_window
        return (
            self._accum_schedule is not None
            or self.accum_iters > 1
            or self.skip_nonfinite
            or self.measure_noise_scale
            or schedules.keyed_on_samples(self._learning_rate)
        )

    # -- The loss and the weight ---------------------------------------------

    def scale_loss(self, loss):
        # `fit` calls this on the micro-batch's loss before differentiating
        # it: multiplying the loss by the micro-batch's weight weighs its
        # gradients for free, instead of multiplying every gradient.
        self._accum_note_loss(loss)
        loss = super().scale_loss(loss)
        handoff = _inputs.handoff_of(self)
        if handoff is None or handoff.loss_scaled or not self._has_window:
            return loss
        handoff.loss_scaled = True
        return ops.multiply(loss, ops.cast(handoff.weight, loss.dtype))

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
        _check_saved_arguments(cls, config)
        return super().from_config(config, custom_objects=custom_objects)


def _check_saved_arguments(cls, config):
    """Raises a `ValueError` that leads with the reason where an
    accumulation argument in `config` (a saved or edited configuration of
    `cls`) is refused.

    Keras wraps a `TypeError` raised by `from_config` in its generic "could
    not be deserialized properly" message, which prints the whole config
    and ends with ours; it passes a `ValueError` on as it is.
    """
    try:
        _args.checked(config)
    except TypeError as error:
        raise ValueError(
            f"{error}. In the saved configuration of {cls.__name__}."
        ) from None


if GradientAccumulation.__doc__:  # None under `python -OO`
    GradientAccumulation.__doc__ = GradientAccumulation.__doc__.format(
        accumulation_args=_args.docstring("the parent optimizer").replace(
            "\n", "\n    "
        )
    )
