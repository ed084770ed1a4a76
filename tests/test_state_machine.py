"""A stateful property test: random sequences of what users do to an
accumulating optimizer, checked after every step against an independent
reference: a numpy model of the window and the parent Keras optimizer fed
the window's (weighted) mean gradient. Drawn runs put the optimizer inside
a `LossScaleOptimizer` (its loss scale modelled by hand), whose
weights-only resume must keep the loss scale, and skip non-finite
micro-batches (`skip_nonfinite`, or the `LossScaleOptimizer`'s own skip).
The window's loss, gradient norm, samples seen and skip count are checked
against the reference's. The end of `fit` is a step too, with and without
`FlushAccumulation`: the pending-window warning, the flush, and the
refusal of micro-batches that compiled code left out of their windows for
a negative or non-finite loss normalizer (`weigh_micro_batches`;
TensorFlow XLA and `jax.jit`: compiled code cannot raise), with
`skip_nonfinite` too (a negative one refused, a non-finite one skipped).
Accumulation arguments are set as attributes after construction, valid
values and refused ones. Layers (nested `AccumBatchNormalization`) are not
part of this machine: they are a model's, tested in
`test_features_combined.py`. Drawn runs also put the optimizer in a
`MultiOptimizer` beside a second one of its kind for the last variable,
checked against Keras' `MultiOptimizer` of the parents: Keras' refuses a
call where one of its optimizers gets no gradient, or not every variable,
so the second always gets its gradient, and neither weights, losses nor
freezing pass through it (the fit fuzzer draws a `MultiOptimizer` in
`fit`)."""

import warnings

import keras
import numpy as np
import pytest
from helpers import PARENTS
from helpers import assert_all_close
from helpers import parent_on_window_means
from helpers import to_numpy
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule

from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import weigh_micro_batches

SHAPES = ((3, 2), (2,), (2, 1))
CLASSES = {
    "adam": (AdamAccumulate, {"learning_rate": 0.05}),
    "sgd": (SGDAccumulate, {"learning_rate": 0.1, "momentum": 0.9}),
}
INITIAL_SCALE, GROWTH = 4.0, 3
# `None` counts 1; the others are micro-batch sizes, token counts, or sums
# of sample weights scaled far from 1 (the big batch does not depend on the
# scale).
weights = st.one_of(
    st.none(), st.sampled_from([1e-8, 1e-6, 0.5, 1.0, 3.0, 7.0, 7e4, 1e30])
)
# Weights no count is, or float32 cannot hold.
bad_weights = st.sampled_from([-1.0, 0.0, 1e-50, 1e-40, 1e39, float("nan")])
# A micro-batch's loss, or none given.
losses = st.one_of(
    st.none(), st.floats(0.0, 10.0, width=32, allow_subnormal=False)
)
# A micro-batch's loss normalizer (the sum of its sample weights) that
# `weigh_micro_batches` refuses.
refused_normalizers = st.sampled_from(
    [-1.0, -1e-6, float("nan"), float("inf"), -float("inf")]
)
# Accumulation arguments set as attributes after construction (and build):
# values the constructor refuses, and values it takes.
attribute_writes = st.sampled_from(
    [
        ("accum_iters", 0),
        ("accum_iters", 2.5),
        ("accum_iters", 3),
        ("accum_iters", 5),
        ("skip_nonfinite", "yes"),
        ("skip_nonfinite", True),
        ("skip_nonfinite", False),
        ("measure_noise_scale", 1),
        ("measure_noise_scale", True),
        ("measure_noise_scale", False),
        ("noise_scale_momentum", 1.0),
        ("noise_scale_momentum", 0.5),
        ("accumulator_dtype", "int32"),
        ("accumulator_dtype", "float64"),
        ("accumulator_dtype", None),
        ("jit_compile", "no"),
        ("jit_compile", False),
        ("jit_compile", "auto"),
        ("decay", -1.0),
        ("decay", "0.1"),
    ]
)
# Where compiled code leaves a micro-batch of a refused normalizer out of its
# window (and `fit` raises at its end); eager code raises at once.
COMPILED = {"tensorflow": "xla", "jax": "jit"}.get(keras.backend.backend())
HAS_MULTI = hasattr(keras.optimizers, "MultiOptimizer")
# Under a `MultiOptimizer`, the last variable's optimizer (`second`).
SECOND = len(SHAPES) - 1
grad_values = st.integers(0, 2**32 - 1).map(
    lambda seed: [
        np.random.default_rng(seed).normal(size=s).astype("float32")
        for s in SHAPES
    ]
)


class _Holder(keras.Model):
    """A model to compile the machine's optimizer with, for
    `FlushAccumulation` and `weigh_micro_batches`: its loss divides by the
    sum of the sample weights."""

    def call(self, inputs):
        return inputs


class AccumulationMachine(RuleBasedStateMachine):
    @initialize(
        name=st.sampled_from(sorted(CLASSES)),
        accum_iters=st.integers(2, 4),
        loss_scaled=st.booleans(),
        skip_nonfinite=st.booleans(),
        multi=st.booleans() if HAS_MULTI else st.just(False),
    )
    def setup(self, name, accum_iters, loss_scaled, skip_nonfinite, multi):
        keras.backend.clear_session(free_memory=False)
        cls, options = CLASSES[name]
        parent_cls = PARENTS[cls]
        self.options = dict(options, skip_nonfinite=skip_nonfinite)
        self.cls, self.accum_iters = cls, accum_iters
        initial = [np.full(s, 0.5, "float32") for s in SHAPES]
        self.variables = [keras.Variable(v) for v in initial]
        self.optimizer = cls(accum_iters=accum_iters, **self.options)
        self.second = None  # the last variable's, under a MultiOptimizer
        self.multi = None
        self.reference = [keras.Variable(v) for v in initial]
        self.parent = parent_cls(**options)
        if multi:
            self.second = cls(accum_iters=accum_iters, **self.options)
            self.multi = _multi(self.optimizer, self.second)
            self.parent = _multi(self.parent, parent_cls(**options))
        self._applying().build(self.variables)
        self.parent.build(self.reference)
        self.window = []  # the reference's pending calls: lists with None
        self.weights = []  # and their weights (None counts 1)
        self.losses = []  # and their losses (None: not given)
        # The last applied window's loss and gradient norm, the total
        # weight of the applied windows, the micro-batches skipped.
        self.window_loss, self.window_grad_norm = 0.0, 0.0
        self.samples, self.skipped = 0.0, 0
        self.frozen = False
        # Micro-batches left out for a refused normalizer since the last
        # end of `fit`, which must raise at the next.
        self.refused = 0
        self.refused_since_creation = 0  # `refused_micro_batches`
        self.holder, self.refusing = _Holder(), {}
        # The loss scale and its step counter, by hand: after `GROWTH`
        # finite steps the scale doubles (Keras' dynamic loss scaling).
        self.wrapper = None
        if loss_scaled:
            self.wrapper = self._wrap(self._applying())
            self.wrapper.build(self.variables)
        self.scale, self.scale_steps = INITIAL_SCALE, 0

    def _applying(self):
        """What the machine calls `apply` on, unless a loss scale wraps
        it: the optimizer, or its `MultiOptimizer`."""
        return self.multi or self.optimizer

    def _ours(self):
        """The accumulating optimizers: the optimizer, and under a
        `MultiOptimizer` the second."""
        return [self.optimizer] + ([self.second] if self.multi else [])

    def _wrapper_apply(self, grads):
        if keras.backend.backend() != "jax":
            return self.wrapper.apply(grads, self.variables)
        # JAX runs a LossScaleOptimizer's branches stateless only.
        state = self.wrapper.variables
        new_variables, new_state = self.wrapper.stateless_apply(
            [v.value for v in state], grads, [v.value for v in self.variables]
        )
        for variable, value in zip(self.variables, new_variables):
            variable.assign(value)
        for variable, value in zip(state, new_state):
            variable.assign(value)

    def _wrap(self, optimizer):
        return keras.optimizers.LossScaleOptimizer(
            optimizer,
            initial_scale=INITIAL_SCALE,
            dynamic_growth_steps=GROWTH,
        )

    def _model(self):
        """The holder model, compiled with the optimizer `fit` would see
        (the `LossScaleOptimizer`, if any) and weighed."""
        optimizer = self.wrapper or self._applying()
        if getattr(self.holder, "optimizer", None) is not optimizer:
            self.holder.compile(
                optimizer=optimizer,
                loss=keras.losses.MeanSquaredError(
                    reduction="mean_with_sample_weight"
                ),
            )
            weigh_micro_batches(self.holder)
        return self.holder

    def _refusing_step(self, scaled):
        """`step(grads, sample_weight)`: a micro-step as a compiled train
        step takes it: the loss computed by the weighed model (which hands
        its normalizer, `sum(sample_weight)`, to the optimizer), then
        `apply` (under `jax.jit`: `stateless_apply`). With `scaled`, as
        Keras' trainers: the loss goes through `optimizer.scale_loss`, which
        multiplies it (so the gradients) by the normalizer; else as a
        custom train step that calls `apply` on the loss's gradients."""
        model, optimizer = self._model(), self.optimizer
        key = (id(optimizer), scaled)
        if key in self.refusing:
            return self.refusing[key][1]
        target = np.zeros((1, 1), "float32")
        prediction = np.ones((1, 1), "float32")

        def loss(grads, sample_weight):
            model.compute_loss(
                y=target, y_pred=prediction, sample_weight=sample_weight
            )
            if not scaled:
                return grads
            factor = optimizer.scale_loss(keras.ops.ones(()))
            return [None if g is None else g * factor for g in grads]

        if COMPILED == "xla":
            import tensorflow as tf

            def apply(grads, sample_weight):
                optimizer.apply(loss(grads, sample_weight), self.variables)

            step = tf.function(apply, jit_compile=True, autograph=False)
        else:
            import jax

            @jax.jit
            def pure(state, trainable, grads, sample_weight):
                with keras.StatelessScope():  # the model's own writes
                    grads = loss(grads, sample_weight)
                return optimizer.stateless_apply(state, grads, trainable)

            def step(grads, sample_weight):
                trainable, state = pure(
                    [v.value for v in optimizer.variables],
                    [v.value for v in self.variables],
                    grads,
                    sample_weight,
                )
                for variable, value in zip(self.variables, trainable):
                    variable.assign(value)
                for variable, value in zip(optimizer.variables, state):
                    variable.assign(value)

        self.refusing[key] = (optimizer, step)
        return step

    # -- The reference ---------------------------------------------------

    def _reference_apply(self, indices):
        parents, groups = [self.parent], [indices]
        if self.multi:  # each parent updates its own variables
            parents = self.parent.optimizers
            groups = [
                [i for i in indices if i != SECOND],
                [i for i in indices if i == SECOND],
            ]
        for parent, group in zip(parents, groups):
            parent_on_window_means(
                parent,
                self.reference,
                [self.window],
                [self.weights],
                updated=group,
            )
        weights = [1.0 if w is None else w for w in self.weights]
        if not indices:  # no update (a flush of frozen variables only)
            self.window, self.weights, self.losses = [], [], []
            return
        if any(loss is None for loss in self.losses):
            self.window_loss = float("nan")
        else:
            self.window_loss = np.average(self.losses, weights=weights)
        squares, overflows = 0.0, False
        # The optimizer's window gradient norm is over its own variables.
        for i in [i for i in indices if not (self.multi and i == SECOND)]:
            zero = np.zeros(SHAPES[i])
            grads = [zero if g[i] is None else g[i] for g in self.window]
            mean = np.average(np.asarray(grads, "float64"), 0, weights)
            squares += float(np.sum(mean**2))
            # The norm is taken from the float32 weighted sums, whose
            # squares overflow for weights near 1e30 (`window_grad_norm`).
            total = np.sum(np.asarray(grads, "float64").T * weights, -1).T
            overflows |= float(np.sum(total**2)) > np.finfo("float32").max
        self.window_grad_norm = np.inf if overflows else np.sqrt(squares)
        self.samples += float(np.sum(np.asarray(weights, "float32")))
        self.window, self.weights, self.losses = [], [], []

    def _call(self, grads, subset, weight=None, loss=None):
        """One micro-step of ours and of the reference."""
        if self.frozen:
            grads = [None] + grads[1:]  # fit passes trainable ones only
        if all(g is None for g in grads):
            return
        tensor = keras.ops.convert_to_tensor
        if self.wrapper is not None:
            # Gradients of the scaled loss (powers of 2: unscaled exactly);
            # `LossScaleOptimizer.apply` takes no `weight` (or `loss`).
            weight = loss = None
            self._wrapper_apply(
                [None if g is None else tensor(g * self.scale) for g in grads]
            )
            if self.scale_steps == GROWTH - 1:
                self.scale, self.scale_steps = self.scale * 2, 0
            else:
                self.scale_steps += 1
        elif self.multi:
            # Its `apply` takes every variable and no weight or loss.
            self.multi.apply(
                [None if g is None else tensor(g) for g in grads],
                self.variables,
            )
            weight = loss = None
        elif subset:
            kept = [i for i, g in enumerate(grads) if g is not None]
            self.optimizer.apply(
                [tensor(grads[i]) for i in kept],
                [self.variables[i] for i in kept],
                weight=weight,
                loss=loss,
            )
        else:
            self.optimizer.apply(
                [None if g is None else tensor(g) for g in grads],
                self.variables,
                weight=weight,
                loss=loss,
            )
        self.window.append(grads)
        self.weights.append(weight)
        self.losses.append(loss)
        if len(self.window) == self.accum_iters:
            self._reference_apply(self._reached())

    def _reached(self):
        """The variables with a gradient in some call of the window and
        trainable now."""
        return [
            i
            for i in range(len(SHAPES))
            if any(g[i] is not None for g in self.window)
            and not (i == 0 and self.frozen)
        ]

    # -- Rules -------------------------------------------------------------

    @rule(grads=grad_values, weight=weights, loss=losses)
    def apply_all(self, grads, weight, loss):
        self._call(grads, subset=False, weight=weight, loss=loss)

    @rule(
        grads=grad_values,
        missing=st.sets(st.integers(0, len(SHAPES) - 1), min_size=1),
        subset=st.booleans(),
        weight=weights,
        loss=losses,
    )
    def apply_some(self, grads, missing, subset, weight, loss):
        if self.multi:
            # Each of its optimizers gets a gradient.
            missing = missing - {SECOND}
            if missing >= set(range(SECOND)):
                missing = missing - {0}
        self._call(
            [None if i in missing else g for i, g in enumerate(grads)],
            subset,
            weight,
            loss,
        )

    @precondition(
        lambda self: self.options["skip_nonfinite"] or self.wrapper is not None
    )
    @rule(
        grads=grad_values,
        position=st.integers(0, len(SHAPES) - 1),
        entry=st.integers(0, 2**16),
        value=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
        weight=weights,
    )
    def apply_nonfinite(self, grads, position, entry, value, weight):
        # Left out: by the LossScaleOptimizer first (which halves its
        # scale), or else by `skip_nonfinite`. Any entry of the gradient.
        grads[position].flat[entry % grads[position].size] = value
        if self.frozen:
            grads = [None] + grads[1:]
            if position == 0:
                return  # the bad gradient is not passed
        tensor = keras.ops.convert_to_tensor
        passed = [None if g is None else tensor(g) for g in grads]
        if self.wrapper is not None:
            self._wrapper_apply(
                [None if g is None else g * self.scale for g in passed]
            )
            self.scale, self.scale_steps = self.scale / 2, 0
        elif self.multi:
            self.multi.apply(passed, self.variables)
            self.skipped += 1
        else:
            self.optimizer.apply(passed, self.variables, weight=weight)
            self.skipped += 1

    @rule(
        grads=grad_values,
        position=st.integers(0, len(SHAPES) - 1),
        bad_weight_value=bad_weights,
    )
    def apply_that_raises(self, grads, position, bad_weight_value):
        # A wrong-shaped gradient, or a weight that is no count. Through a
        # `MultiOptimizer`, no optimizer in it may write.
        bad_weight = position == 0 and not self.multi
        if not bad_weight:
            grads[position] = np.ones((1,) * len(SHAPES[position]), "float32")
        applying = self._applying()
        before = to_numpy(self.variables) + to_numpy(applying.variables)
        weight = {"weight": bad_weight_value} if bad_weight else {}
        try:
            applying.apply(
                [keras.ops.convert_to_tensor(g) for g in grads],
                self.variables,
                **weight,
            )
        except ValueError as error:
            assert ("weight" if bad_weight else "shape") in str(error)
        else:
            raise AssertionError("a bad call was accepted")
        after = to_numpy(self.variables) + to_numpy(applying.variables)
        for a, b in zip(after, before):
            np.testing.assert_array_equal(a, b)

    @rule(write=attribute_writes)
    def set_attribute(self, write):
        # What the constructor refuses is refused, naming the argument and
        # the value; what the built optimizer cannot take (its window's
        # variables, its sums' dtype) too; the rest takes effect.
        name, value = write
        refused = {
            # A pending window must fit the new size.
            "accum_iters": not isinstance(value, int)
            or len(self.window) >= value,
            "skip_nonfinite": not isinstance(value, bool),
            "measure_noise_scale": value is not False,
            "noise_scale_momentum": value == 1.0,
            "accumulator_dtype": value is not None,
            "jit_compile": value == "no",
            "decay": True,
        }[name]
        before = [getattr(o, name) for o in self._ours()]
        try:
            with warnings.catch_warnings():
                # (That a compiled step keeps the old value.)
                warnings.simplefilter("ignore")
                for optimizer in self._ours():
                    setattr(optimizer, name, value)
        except (TypeError, ValueError) as error:
            assert refused, error
            assert name in str(error) and repr(value) in str(error), error
            assert [getattr(o, name) for o in self._ours()] == before
            return
        assert not refused, f"{name}={value!r} was accepted"
        assert all(getattr(o, name) == value for o in self._ours())
        if name == "accum_iters":
            self.accum_iters = value
        if name == "skip_nonfinite":
            self.options["skip_nonfinite"] = value
        self.refusing = {}  # its compiled steps are traced again

    @precondition(lambda self: not self.multi)  # Keras' refuses a subset
    @rule()
    def freeze_or_unfreeze(self):
        self.frozen = not self.frozen
        self.variables[0].trainable = not self.frozen

    @rule()
    def flush(self):
        for optimizer in self._ours():
            optimizer.flush()
        if self.window:
            self._reference_apply(self._reached())

    @precondition(
        lambda self: (
            COMPILED is not None and self.wrapper is None and self.multi is None
        )
    )
    @rule(
        grads=grad_values, normalizer=refused_normalizers, scaled=st.booleans()
    )
    def apply_refused_normalizer(self, grads, normalizer, scaled):
        # Compiled code cannot raise: the micro-batch is left out of its
        # window (counted in `refused_micro_batches`), and the end of `fit`
        # raises for it. Under `skip_nonfinite`, a non-finite normalizer
        # marks a micro-batch to skip instead (`skipped_micro_batches`).
        if self.frozen:
            grads = [None] + grads[1:]
        tensor = keras.ops.convert_to_tensor
        self._refusing_step(scaled)(
            [None if g is None else tensor(g) for g in grads],
            tensor(np.asarray([normalizer], "float32")),
        )
        if self.options["skip_nonfinite"] and not np.isfinite(normalizer):
            self.skipped += 1
        else:
            self.refused += 1
            self.refused_since_creation += 1

    @rule(flush=st.booleans())
    def end_of_fit(self, flush):
        # What `fit` does once its last epoch's steps are done, in Keras'
        # order: `on_epoch_end` (with `FlushAccumulation`: the flush), the
        # optimizer's `finalize_variable_values`, then `on_train_end`,
        # which `fit` skips when the finalize raises.
        model = self._model()
        callback = FlushAccumulation(every_epoch=False, at_train_end=True)
        if flush:
            callback.set_model(model)
            callback.set_params({"epochs": 1})
            callback.on_train_begin()
            callback.on_epoch_begin(0)
            callback.on_epoch_end(0)
            if self.window:
                self._reference_apply(self._reached())
        pending, refused = len(self.window), self.refused
        self.refused = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model.optimizer.finalize_variable_values(self.variables)
            except ValueError as error:
                assert refused and "normalizer" in str(error), error
                assert f"{refused} micro-batches" in str(error), error
                return
        assert not refused, f"{refused} refused micro-batches not reported"
        warned = [str(w.message) for w in caught if "pending" in str(w.message)]
        if flush or not pending:
            assert not warned, warned
        else:  # one per accumulating optimizer
            assert len(warned) == len(self._ours()), warned
            assert all(f"{pending} micro-batches" in w for w in warned)
        if flush:
            callback.on_train_end()  # nothing more is pending

    @rule(before_build=st.booleans())
    def save_and_load(self, before_build):
        # As Keras' saving stores them: a LossScaleOptimizer's variables
        # (its own and the inner optimizer's), and the inner one's.
        # Under a `MultiOptimizer`, each of its optimizers' own.
        stores, wrapper_store = [{} for _ in self._ours()], {}
        for optimizer, store in zip(self._ours(), stores):
            optimizer.save_own_variables(store)
        if self.wrapper is not None:
            self.wrapper.save_own_variables(wrapper_store)
        restored = [
            self.cls(accum_iters=self.accum_iters, **self.options)
            for _ in stores
        ]
        multi = _multi(*restored) if self.multi else None
        inner = multi or restored[0]
        wrapper = None if self.wrapper is None else self._wrap(inner)
        built = wrapper or inner

        def load():
            if wrapper is not None:
                wrapper.load_own_variables(wrapper_store)
            for optimizer, store in zip(restored, stores):
                optimizer.load_own_variables(store)

        if before_build and wrapper is not None and multi is not None:
            # Keras' MultiOptimizer, whose map is a function, knows its
            # optimizers only once built: the loss scale loaded before
            # then skips its state, warning, and starts again.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                load()
            assert any(
                f"loading for optimizer '{wrapper.name}'" in str(w.message)
                for w in caught
            ), [str(w.message) for w in caught]
            built.build(self.variables)
            self.scale, self.scale_steps = INITIAL_SCALE, 0
        elif before_build:  # weights-only resume: load, then build
            load()
            built.build(self.variables)
        else:
            built.build(self.variables)
            load()
        self.optimizer, self.wrapper, self.multi = restored[0], wrapper, multi
        self.second = restored[1] if multi else None
        self.refused = 0  # the saved run's `fit` reports its refusals

    @precondition(
        lambda self: self.window and self.wrapper is None and not self.multi
    )
    @rule(accum_iters=st.integers(2, 5))
    def load_into_another_accum_iters(self, accum_iters):
        store = {}
        self.optimizer.save_own_variables(store)
        restored = self.cls(accum_iters=accum_iters, **self.options)
        restored.build(self.variables)
        try:
            restored.load_own_variables(store)
        except ValueError as error:
            assert len(self.window) >= accum_iters, error
            return
        assert len(self.window) < accum_iters
        self.optimizer, self.accum_iters = restored, accum_iters
        self.refused = 0  # the saved run's `fit` reports its refusals

    # -- Invariants --------------------------------------------------------

    @invariant()
    def same_weights_and_state_as_the_reference(self):
        assert_all_close(
            self.variables,
            self.reference,
            rtol=1e-5,
            atol=1e-6,
            what="variable",
        )
        parents = self.parent.optimizers if self.multi else [self.parent]
        for ours, parent in zip(self._ours(), parents):
            assert_all_close(
                ours.variables[: len(parent.variables)],
                parent.variables,
                rtol=1e-5,
                atol=1e-6,
                what="optimizer variable",
            )
            assert int(ours.micro_steps) == len(self.window)
            assert int(ours.skipped_micro_batches) == self.skipped
            refused = int(ours.refused_micro_batches)
            assert refused == self.refused_since_creation
        np.testing.assert_allclose(
            float(self.optimizer.samples_seen), self.samples, rtol=1e-6
        )
        np.testing.assert_allclose(
            float(self.optimizer.window_loss), self.window_loss, rtol=1e-5
        )
        np.testing.assert_allclose(
            float(self.optimizer.window_grad_norm),
            self.window_grad_norm,
            rtol=1e-5,
            atol=1e-7,
        )
        if self.wrapper is not None:
            scale = to_numpy([self.wrapper.dynamic_scale])[0]
            steps = to_numpy([self.wrapper.step_counter])[0]
            assert (float(scale), int(steps)) == (self.scale, self.scale_steps)


def _multi(first, second):
    """A `MultiOptimizer`: `second` for the last variable, `first` for the
    others."""
    return keras.optimizers.MultiOptimizer(
        lambda v: second if tuple(v.shape) == SHAPES[SECOND] else first
    )


AccumulationMachine.TestCase.settings = settings(
    settings.default,
    max_examples=max(8, settings.default.max_examples * 2 // 3),
    stateful_step_count=15,
)
TestAccumulationMachine = AccumulationMachine.TestCase


@pytest.mark.backends("tensorflow", "jax")  # compiled code leaves them out
def test_refused_normalizers_raise_at_the_end_of_fit_with_or_without_flush():
    # A sequence of the machine's rules that CI's few drawn runs seldom
    # reach: micro-batches left out for a refused normalizer (with and
    # without `scale_loss`) between good ones, then the end of `fit` with
    # the flush (which must still raise for them) and without it (the
    # pending-window warning), checked after every step.
    grads = [np.full(s, 0.25, "float32") for s in SHAPES]
    machine = AccumulationMachine()
    machine.setup(
        "adam", 2, loss_scaled=False, skip_nonfinite=False, multi=False
    )
    steps = [
        lambda: machine.apply_all(grads, weight=3.0, loss=None),
        lambda: machine.apply_refused_normalizer(grads, -1.0, scaled=False),
        lambda: machine.apply_refused_normalizer(grads, np.nan, scaled=True),
        lambda: machine.apply_all(grads, weight=None, loss=1.0),
        lambda: machine.apply_all(grads, weight=0.5, loss=None),
        lambda: machine.end_of_fit(flush=True),
        lambda: machine.apply_refused_normalizer(grads, -1e-6, scaled=False),
        lambda: machine.apply_some(grads, {0}, False, weight=7.0, loss=None),
        lambda: machine.end_of_fit(flush=False),
        lambda: machine.end_of_fit(flush=False),
    ]
    for step in steps:
        step()
        machine.same_weights_and_state_as_the_reference()
    assert int(to_numpy(machine.optimizer.iterations)) == 2


@pytest.mark.backends("tensorflow", "jax")
def test_a_fit_that_raised_with_the_flush_leaves_the_next_fit_its_warning():
    grads = [np.full(s, 0.25, "float32") for s in SHAPES]
    machine = AccumulationMachine()
    machine.setup(
        "sgd", 2, loss_scaled=False, skip_nonfinite=False, multi=False
    )
    machine.apply_refused_normalizer(grads, -1.0, scaled=False)
    machine.end_of_fit(flush=True)  # raises for the refused micro-batch
    machine.apply_all(grads, weight=None, loss=None)
    machine.end_of_fit(flush=False)  # the pending-window warning


@pytest.mark.backends("tensorflow", "jax")
def test_a_loaded_optimizer_does_not_report_its_saved_runs_refusals_again():
    grads = [np.full(s, 0.25, "float32") for s in SHAPES]
    machine = AccumulationMachine()
    machine.setup(
        "sgd", 2, loss_scaled=False, skip_nonfinite=False, multi=False
    )
    machine.apply_refused_normalizer(grads, -1.0, scaled=False)
    machine.end_of_fit(flush=False)  # raises for it
    machine.save_and_load(before_build=False)
    machine.end_of_fit(flush=False)  # nothing refused since


@pytest.mark.backends("tensorflow", "jax")
def test_under_skip_nonfinite_a_negative_normalizer_is_refused_not_skipped():
    # Compiled code skipped it as a non-finite micro-batch, and `fit` did
    # not raise; a non-finite normalizer is still a skip.
    grads = [np.full(s, 0.25, "float32") for s in SHAPES]
    machine = AccumulationMachine()
    machine.setup("sgd", 2, loss_scaled=False, skip_nonfinite=True, multi=False)
    steps = [
        lambda: machine.apply_refused_normalizer(grads, -1.0, scaled=True),
        lambda: machine.apply_refused_normalizer(grads, np.nan, scaled=False),
        lambda: machine.apply_all(grads, weight=2.0, loss=None),
        lambda: machine.set_attribute(("jit_compile", "no")),
        lambda: machine.set_attribute(("skip_nonfinite", False)),
        lambda: machine.apply_refused_normalizer(grads, -1e-6, scaled=False),
        lambda: machine.end_of_fit(flush=True),  # raises for the 2 refused
        lambda: machine.save_and_load(before_build=False),
        lambda: machine.end_of_fit(flush=False),  # nothing refused since
    ]
    for step in steps:
        step()
        machine.same_weights_and_state_as_the_reference()
    assert int(to_numpy(machine.optimizer.refused_micro_batches)) == 2
    assert int(to_numpy(machine.optimizer.skipped_micro_batches)) == 1
