"""Whole training runs for the fit-level differential fuzzer
(`test_fit_fuzzer.py`): a drawn `Run`, the run itself (`train_ours`), and
the independent oracle (`train_parent`): the parent Keras optimizer fed
each window's big batch, with the counters worked out by hand in numpy.

The oracle knows the contract, not the code: a window is the next
`accum_iters` micro-batches that reach it with finite gradients (the
schedule read at the window's update count or samples seen), the epoch's
pending window is applied at its end under `FlushAccumulation`, and a
window's update is the parent's step on its micro-batches concatenated,
each sample weighed so that the big batch's loss is the window's:

- weighted windows (`weigh_micro_batches`): sum_i w_i l_i / sum_j n_j,
  where n_j is the count micro-batch j's loss was divided by;
- unweighted windows: the plain mean of the micro-batches' losses,
  (1/K) sum_j sum_{i in j} w_i l_i / n_j.

The parent is compiled with `sum_over_batch_size`, so the weight it gets
for sample i is c_i = N * (the coefficient of l_i above), N the big
batch's size. Its `train_on_batch` returns the loss of its forward pass,
at the window's starting weights: the window's loss (contract 13).

With `measure_noise_scale` (`Run.noise`), `NoiseOracle` works out the read-
outs from each window's micro-batch gradients at its starting weights (the
parent's), in float64 numpy (`helpers.small_model_gradients`): the paper's
two estimates per window (`helpers.noise_estimates`), their moving
averages and ratio; under `by_noise_scale` it also sizes the windows, from
its own noise scale. Under a `MultiOptimizer` (`Run.multi`) there is one
oracle per inner optimizer, over its own variables, and the logger's
noise scale is the ratio of their averages summed.
"""

import dataclasses
import os
import warnings
from typing import Optional

import keras
import numpy as np
from helpers import noise_estimate_scales
from helpers import noise_estimates
from helpers import small_embedding_model
from helpers import small_embedding_model_gradients
from helpers import small_model
from helpers import small_model_gradients
from helpers import to_numpy

import accum_optimizers as ao
from accum_optimizers import schedules as ao_schedules

BACKEND = keras.backend.backend()
SEED = 3

OPTIMIZERS = {
    "adam": (ao.AdamAccumulate, keras.optimizers.Adam, {"learning_rate": 0.02}),
    "sgd": (
        ao.SGDAccumulate,
        keras.optimizers.SGD,
        {"learning_rate": 0.1, "momentum": 0.9},
    ),
    "rmsprop": (
        ao.RMSpropAccumulate,
        keras.optimizers.RMSprop,
        {"learning_rate": 0.01},
    ),
}
# Under mixed_float16 both runs get a LossScaleOptimizer with this scale:
# Keras' default (32768) overflows the first steps of this model's float16
# loss, and the two runs would then skip different groupings of samples.
LOSS_SCALE = 16.0


@dataclasses.dataclass
class Run:
    """One drawn training run. `accum` is an int, a dict keyed on applied
    updates, `("samples", {samples: k})` for `by_samples`, or `("noise",
    {argument: value})` for `by_noise_scale` (with `noise`)."""

    optimizer: str = "adam"
    clipnorm: Optional[float] = None
    weight_decay: Optional[float] = None
    accum: object = 2
    micro_batch: int = 4
    samples: int = 16
    epochs: int = 1
    weighted: bool = False
    sample_weight: bool = False
    reduction: str = "sum_over_batch_size"
    flush: bool = False
    skip: bool = False
    bad: tuple = ()  # micro-batches (of the epoch) with a NaN input
    policy: str = "float32"
    steps_per_execution: int = 1
    logger: bool = False
    # None, or how training continues after `resume_at` micro-batches:
    # "keras" or "weights" (saved, loaded), "continue" (a second `fit`).
    resume: Optional[str] = None
    resume_at: int = 1
    accum_after: Optional[int] = None  # `accum_iters` set at the split
    # Accumulation arguments set as attributes at the split, before the
    # save: `(name, value)` pairs (`ATTRIBUTE_WRITES`).
    writes: tuple = ()
    jit_compile: object = "auto"
    run_eagerly: bool = False
    # The optimizers' `jit_compile` (True, False or "auto"): their close
    # compiled by XLA in a TensorFlow graph where True (the fuzzer's models
    # are below "auto"'s size).
    compile_close: object = "auto"
    # `measure_noise_scale` and `noise_scale_momentum`.
    noise: bool = False
    noise_momentum: float = 0.99
    # An AdaScale learning rate (SGD, with `noise`): the base batch is one
    # micro-batch (its samples in weighted windows).
    adascale: bool = False
    # AdaScale turned on at the resume ("keras": `load_weights` of the
    # `.keras` file; "weights"): the first part trains at the base rate.
    adascale_from_resume: bool = False
    # A scaling rule's learning rate ("linear" or "sqrt", any optimizer;
    # the base batch as AdaScale's), and the linear rule's warm-up.
    rule: Optional[str] = None
    rule_warmup: float = 0.0
    # Micro-batches (of the epoch) whose sample weights are all 0.
    weightless: tuple = ()
    # "dense" (`helpers.small_model`) or "embedding"
    # (`helpers.small_embedding_model`, whose gradient on TensorFlow is an
    # `IndexedSlices`).
    model: str = "dense"
    # A `MultiOptimizer`: the model's last layer gets the second optimizer
    # (`MULTI_SECOND`), the other layers the drawn one; both accumulate.
    multi: bool = False
    # How it maps them: "map" (an `OptimizerMap`) or "function" (which
    # names its optimizers only once built).
    multi_map: str = "map"
    # TensorFlow: a graph check, which XLA would compile as nothing:
    # "constraint", `check_numerics` on the first variable (finite here:
    # the runs end alike), or "schedule", a rate that asserts the update
    # count is below `check_updates` (both runs raise, or neither).
    graph_check: Optional[str] = None
    check_updates: int = 1

    @property
    def micro_batches(self):
        return -(-self.samples // self.micro_batch)

    @property
    def loss_scaled(self):
        return self.policy == "mixed_float16"

    @property
    def windowless(self):
        """Whether the optimizer keeps no window (before a resume that
        sets `accum_after`): `accum_iters=1` without skipping, measuring
        the noise scale or a scaling rule."""
        return (
            self.accum == 1
            and not self.skip
            and not self.noise
            and self.rule is None
        )

    @property
    def noise_schedule(self):
        """`by_noise_scale`'s arguments, or `None`."""
        if isinstance(self.accum, tuple) and self.accum[0] == "noise":
            return self.accum[1]
        return None


def data(run):
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(run.samples, 4)).astype("float32")
    y = rng.normal(size=(run.samples, 2)).astype("float32")
    for j in run.bad:
        # Its loss and gradients are NaN.
        if run.model == "embedding":
            y[j * run.micro_batch, 0] = np.nan
        else:
            x[j * run.micro_batch, 0] = np.nan
    if run.model == "embedding":
        tokens = np.random.default_rng(SEED + 1).integers(
            0, 7, size=(run.samples, 3)
        )
        x = tokens.astype("int32")
    if not run.sample_weight:
        return x, y, None
    if run.reduction == "mean_with_sample_weight":
        w = rng.choice([0.5, 1.0, 3.0], size=run.samples)
    else:
        w = rng.choice([0.0, 0.5, 1.0, 3.0], size=run.samples)
    for j in run.weightless:
        w[_rows(run, j)] = 0.0
    return x, y, w.astype("float32")


def accum_iters_argument(run):
    if run.noise_schedule is not None:
        return ao_schedules.by_noise_scale(**run.noise_schedule)
    if isinstance(run.accum, tuple):
        return ao_schedules.by_samples(dict(run.accum[1]))
    return dict(run.accum) if isinstance(run.accum, dict) else run.accum


def window_size(run, updates, samples, noise=None):
    """The oracle's schedule: the window that produces the next update
    (`noise`: the `NoiseOracle` a `by_noise_scale` run reads)."""
    if isinstance(run.accum, int):
        return run.accum
    if run.noise_schedule is not None:
        return noise.window_size(**run.noise_schedule)
    if isinstance(run.accum, tuple):
        key, table = samples, run.accum[1]
    else:
        key, table = updates, run.accum
    return table[max(start for start in table if start <= key)]


def _options(run):
    cls, parent_cls, options = OPTIMIZERS[run.optimizer]
    options = dict(options)
    if run.graph_check == "schedule":
        options["learning_rate"] = CheckedRate(
            options["learning_rate"], run.check_updates
        )
    if run.clipnorm is not None:
        options["clipnorm"] = run.clipnorm
    if run.weight_decay is not None:
        options["weight_decay"] = run.weight_decay
    return cls, parent_cls, options


def _loss(run):
    return keras.losses.MeanSquaredError(reduction=run.reduction)


def make_model(run=None):
    # A `MultiOptimizer` maps the last layer by its path, which a loaded
    # model must keep.
    head_name = "head" if run is not None and run.multi else None
    if run is not None and run.model == "embedding":
        model = small_embedding_model(SEED, head_name=head_name)
    else:
        model = small_model(SEED, head_name=head_name)
    return with_graph_check(run, model)


# What the graph checks' errors say.
CHECK_MESSAGE = "graph check failed"


@keras.saving.register_keras_serializable(package="fuzz_runs")
class CheckedRate(keras.optimizers.schedules.LearningRateSchedule):
    """A constant `rate` that asserts the update count is below
    `updates` (`tf.debugging.assert_less`)."""

    def __init__(self, rate, updates):
        self.rate = rate
        self.updates = updates

    def __call__(self, step):
        import tensorflow as tf

        tf.debugging.assert_less(
            step, tf.cast(self.updates, step.dtype), message=CHECK_MESSAGE
        )
        return tf.constant(self.rate, "float32")

    def get_config(self):
        return {"rate": self.rate, "updates": self.updates}


def with_graph_check(run, model):
    """`model`, its first variable checked by `check_numerics` where the
    run draws a checking constraint (a variable's constraint, which a
    `.keras` file does not keep: set again on a loaded model)."""
    if run is not None and run.graph_check == "constraint":
        import tensorflow as tf

        model.trainable_variables[0].constraint = lambda w: (
            tf.debugging.check_numerics(w, CHECK_MESSAGE)
        )
    return model


def graph_check_failed(run, error):
    """Whether `error` is the run's graph check failing."""
    if run.graph_check is None:
        return False
    import tensorflow as tf

    return isinstance(error, tf.errors.InvalidArgumentError) and (
        CHECK_MESSAGE in str(error)
    )


def model_gradients(run):
    """The numpy gradients of the run's model (`helpers`)."""
    if run.model == "embedding":
        return small_embedding_model_gradients
    return small_model_gradients


def _compile_ours(run, model, adascale=None):
    """Compiles `model` with the run's optimizer; `adascale`: whether its
    rate is AdaScale's (the run's, but before a resume that turns it on)."""
    if adascale is None:
        adascale = run.adascale and not run.adascale_from_resume
    cls, _, options = _options(run)
    measuring = {}
    if run.noise:
        measuring = {
            "measure_noise_scale": True,
            "noise_scale_momentum": run.noise_momentum,
        }
    options.update(measuring)
    if adascale:
        options["learning_rate"] = ao_schedules.adascale(
            options["learning_rate"], base_batch_size=adascale_base(run)
        )
    if run.rule == "linear":
        options["learning_rate"] = ao_schedules.linear_scaling(
            options["learning_rate"],
            base_batch_size=adascale_base(run),
            warmup_steps=run.rule_warmup,
        )
    elif run.rule == "sqrt":
        options["learning_rate"] = ao_schedules.sqrt_scaling(
            options["learning_rate"], base_batch_size=adascale_base(run)
        )
    optimizer = cls(
        accum_iters=accum_iters_argument(run),
        skip_nonfinite=run.skip,
        jit_compile=run.compile_close,
        **options,
    )
    if run.multi:
        second_cls, _, second_options = _options(
            dataclasses.replace(run, optimizer=MULTI_SECOND)
        )
        second = second_cls(
            accum_iters=accum_iters_argument(run),
            skip_nonfinite=run.skip,
            jit_compile=run.compile_close,
            **second_options,
            **measuring,
        )
        optimizer = _multi_optimizer(model, optimizer, second, run.multi_map)
    if run.loss_scaled:
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=LOSS_SCALE
        )
    model.compile(
        optimizer=optimizer,
        loss=_loss(run),
        jit_compile=run.jit_compile,
        run_eagerly=run.run_eagerly,
        steps_per_execution=run.steps_per_execution,
    )
    return model


MULTI_SECOND = "sgd"


def _multi_optimizer(model, first, second, mapped_by="map"):
    """A `MultiOptimizer`: `second` for the model's last layer, `first` for
    the others, named by an `OptimizerMap` or by a function."""
    last = f"/{model.layers[-1].name}/"
    if mapped_by == "function":
        return keras.optimizers.MultiOptimizer(
            lambda v: second if last in v.path else first
        )
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(first, {f".*{last}.*": second})
    )


def adascale_base(run):
    """AdaScale's base batch in the noise scale's unit: one micro-batch;
    a scaling rule's too."""
    return float(run.micro_batch) if run.weighted else 1.0


def rule_factor(run, scale, tau):
    """A scaling rule's factor of the base rate for a window `scale` times
    the base batch at `tau`, as the docs define it (float64)."""
    if run.rule == "sqrt":
        return float(np.sqrt(scale))
    if not run.rule_warmup or scale <= 1:
        return scale
    return 1 + (scale - 1) * min(1.0, tau / run.rule_warmup)


def accumulating(model):
    """The model's optimizer inside its `LossScaleOptimizer`, if any: the
    accumulating one, or a `MultiOptimizer` of them."""
    optimizer = model.optimizer
    return getattr(optimizer, "inner_optimizer", optimizer)


# Attribute writes a run draws at its split: values the constructor
# refuses (refused when set too, naming the argument and the value, and
# nothing changes), and `jit_compile`s the next `fit` takes.
REFUSED_WRITES = (
    ("accum_iters", 0),
    ("skip_nonfinite", "yes"),
    ("measure_noise_scale", 1),
    ("noise_scale_momentum", 1.0),
    ("accumulator_dtype", "int32"),
    ("jit_compile", "no"),
    ("decay", -1.0),
)
ATTRIBUTE_WRITES = REFUSED_WRITES + tuple(
    ("jit_compile", value) for value in (True, False, "auto")
)


def write_attribute(optimizers, name, value):
    """Sets `name` to `value` on each of `optimizers`, checking that a
    value of `REFUSED_WRITES` is refused and changes nothing."""
    for optimizer in optimizers:
        before = getattr(optimizer, name)
        if (name, value) not in REFUSED_WRITES:
            with warnings.catch_warnings():
                # (That a compiled train function keeps the old value.)
                warnings.simplefilter("ignore")
                setattr(optimizer, name, value)
            assert getattr(optimizer, name) == value
            continue
        try:
            setattr(optimizer, name, value)
        except (TypeError, ValueError) as error:
            assert name in str(error) and repr(value) in str(error), error
        else:
            raise AssertionError(f"{name}={value!r} was accepted")
        assert getattr(optimizer, name) == before


def accumulating_ones(model):
    """The model's accumulating optimizers: one, or a `MultiOptimizer`'s."""
    optimizer = accumulating(model)
    return list(getattr(optimizer, "optimizers", [optimizer]))


def outcome(model, logged=()):
    """What a run ends with, as `assert_same_run` compares it: the weights,
    the optimizer's counters and last window's loss, and the
    `(update, window loss)` pairs a logger recorded. A `MultiOptimizer`'s
    optimizers count alike (checked here), and its `iterations` counts
    their updates."""
    counts = [
        {
            "iterations": int(to_numpy(optimizer.iterations)),
            "skipped": int(to_numpy(optimizer.skipped_micro_batches)),
            "samples_seen": float(to_numpy(optimizer.samples_seen)),
            "window_loss": float(to_numpy(optimizer.window_loss)),
        }
        for optimizer in accumulating_ones(model)
    ]
    if len(counts) > 1:
        assert all(other == counts[0] for other in counts[1:]), counts
        iterations = int(to_numpy(model.optimizer.iterations))
        assert iterations == counts[0]["iterations"], (iterations, counts)
    return {"weights": model.get_weights(), **counts[0], "logged": list(logged)}


def initial_weights(run):
    keras.config.set_dtype_policy(run.policy)
    return make_model(run).get_weights()


def train_ours(run, tmp_path):
    """Trains the run with our optimizer in `fit`; returns its outcome."""
    keras.config.set_dtype_policy(run.policy)
    x, y, w = data(run)
    model = _compile_ours(run, make_model(run))
    windows = []
    noise_logged = []  # (update, noise_scale) as the logger recorded them

    def fit(model, start, stop, flush):
        if run.weighted:
            ao.weigh_micro_batches(model)
        callbacks = [ao.FlushAccumulation()] if flush else []
        logger = ao.AccumulationLogger(update_freq="batch")
        if run.logger:
            callbacks.append(logger)
        part = slice(start, stop)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # a window left pending...
            model.fit(
                x[part],
                y[part],
                sample_weight=None if w is None else w[part],
                batch_size=run.micro_batch,
                epochs=run.epochs,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        # A `MultiOptimizer`'s two optimizers share the drawn window.
        apart = [c.message for c in caught if "update at" in str(c.message)]
        assert not apart, apart
        for record in zip(
            logger.windows["updates"], logger.windows["window_loss"]
        ):
            # A resumed run's logger sees the loaded last update again.
            if not windows or record[0] != windows[-1][0]:
                windows.append(record)
        for record in zip(
            logger.windows["updates"], logger.windows.get("noise_scale", [])
        ):
            if not noise_logged or record[0] != noise_logged[-1][0]:
                noise_logged.append(record)

    if run.resume is None:
        fit(model, 0, run.samples, run.flush)
    else:
        split = run.resume_at * run.micro_batch
        fit(model, 0, split, flush=False)  # a flush would end the window
        for name, value in run.writes:  # saved with the model, if it is
            write_attribute(accumulating_ones(model), name, value)
        if run.writes:
            model.make_train_function(force=True)
        if run.resume != "continue":
            model = _resumed(run, model, tmp_path)
        if run.accum_after is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # what the next line does
                for optimizer in accumulating_ones(model):
                    optimizer.accum_iters = run.accum_after
            # A compiled train function keeps the window size it was
            # traced with (the setter's warning says so).
            model.make_train_function(force=True)
        fit(model, split, run.samples, run.flush)
    return {
        **outcome(model, windows),
        **noise_outcome(run, _in_model_order(model), noise_logged),
        **rule_outcome(run, accumulating(model)),
    }


def _in_model_order(model):
    """The model's accumulating optimizers in the order of their first
    variable among the model's weights (the noise oracles' order)."""
    position = {v.path: i for i, v in enumerate(model.weights)}
    return sorted(
        accumulating_ones(model),
        key=lambda o: min(position[v.path] for v in o._trainable_variables),
    )


def _resumed(run, model, tmp_path):
    if run.resume == "keras":
        path = os.path.join(tmp_path, "run.keras")
        model.save(path)
        if not run.adascale_from_resume:
            return with_graph_check(run, keras.models.load_model(path))
    else:
        path = os.path.join(tmp_path, "run.weights.h5")
        model.save_weights(path)
    fresh = _compile_ours(run, make_model(run), adascale=run.adascale)
    if run.multi_map == "function":
        # It names its optimizers only once built (docs/saving.md).
        fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    return fresh


def pending_at_resume(run):
    """How many micro-batches the window holds when a resumed run is saved
    (`resume_at` micro-batches in)."""
    windows, _, _ = expected_windows(
        dataclasses.replace(run, resume=None, accum_after=None, flush=False)
    )
    closed = sum(
        len(window) for window in windows if window[-1] < run.resume_at
    )
    taken = [j for j in range(run.resume_at) if j not in run.bad]
    return len(taken) - closed


def expected_windows(run, on_close=None, noise=None):
    """The oracle's windows, in order: lists of micro-batch indices (of the
    epoch), and the number of micro-batches skipped. `on_close(window)` is
    called as each window closes, before the next one's size is read (from
    `noise`, a `NoiseOracle`, under `by_noise_scale`: `on_close` moves it
    on)."""
    windows, pending, skipped = [], [], 0
    updates, samples = 0, 0.0
    x, _, w = data(run)
    counts = [_count(run, w, j) for j in range(run.micro_batches)]

    def close():
        nonlocal pending, updates, samples
        windows.append(pending)
        if on_close is not None:
            on_close(pending)
        updates += 1
        if run.weighted and not _windowless_update(run, pending):
            samples += sum(counts[j] for j in pending)
        else:
            samples += len(pending)
        pending = []

    for _ in range(run.epochs):
        for j in range(run.micro_batches):
            if j in run.bad:
                # A LossScaleOptimizer drops it before the window sees it.
                skipped += 0 if run.loss_scaled else 1
                continue
            pending.append(j)
            size = window_size(run, updates, samples, noise)
            if run.accum_after is not None and j >= run.resume_at:
                size = run.accum_after
            if len(pending) >= size:
                close()
        if run.flush and pending:
            close()
    return windows, skipped, samples


def _windowless_update(run, window):
    """Whether `window` is an update of the optimizer without a window
    (before a weights-only resume that gave it one): the parent's own
    update, whose `window_loss` is 0 and which counts one in
    `samples_seen`, samples or not (docs/window-features.md)."""
    if not run.windowless:
        return False
    return run.accum_after in (None, 1) or window[-1] < run.resume_at


def _rows(run, j):
    return np.arange(
        j * run.micro_batch, min((j + 1) * run.micro_batch, run.samples)
    )


def _count(run, w, j):
    """What micro-batch j's loss is divided by."""
    rows = _rows(run, j)
    if run.reduction == "mean_with_sample_weight" and w is not None:
        return float(np.sum(w[rows], dtype="float64"))
    return float(len(rows))


def train_parent(run):
    """The oracle: the parent optimizer on each window's big batch. Under a
    16-bit policy, also `"weights_float32"`: the same in float32, whose
    distance from the 16-bit run is the parent's own round-off."""
    outcome = _train_parent(run)
    if run.policy != "float32":
        twin = _train_parent(dataclasses.replace(run, policy="float32"))
        outcome["weights_float32"] = twin["weights"]
    return outcome


def _train_parent(run):
    keras.config.set_dtype_policy(run.policy)
    x, y, w = data(run)
    _, parent_cls, options = _options(run)
    optimizers = [parent_cls(**options)]
    if run.multi:
        _, second_cls, second_options = _options(
            dataclasses.replace(run, optimizer=MULTI_SECOND)
        )
        optimizers.append(second_cls(**second_options))
    # The update of the window being trained (`train` sets it).
    current = {"window": None}
    if run.model == "embedding" and BACKEND == "tensorflow":
        for optimizer in optimizers:
            _take_dense_gradients(
                optimizer,
                lambda: not _windowless_update(run, current["window"]),
            )
    model = make_model(run)
    optimizer = optimizers[0]
    if run.multi:
        optimizer = _multi_optimizer(model, *optimizers)
    if run.loss_scaled:
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=LOSS_SCALE
        )
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    losses = []
    ones = np.ones(run.samples, "float64")
    weights = ones if w is None else w.astype("float64")
    # Under a `MultiOptimizer` each optimizer measures its own variables:
    # the last layer's (its last two weights) and the others'.
    noises = []
    if run.noise:
        noises = [NoiseOracle(run)]
        if run.multi:
            head = len(model.get_weights()) - 2
            noises = [
                NoiseOracle(run, slice(0, head)),
                NoiseOracle(run, slice(head, None)),
            ]
    noise = noises[0] if noises else None
    scales = []  # a scaling rule's `S` of each update

    def train(window):
        """The parent's step on the window's big batch (and the noise
        scale's estimates from its micro-batches, before, at the window's
        starting weights)."""
        current["window"] = window
        counts = [_count(run, w, j) for j in window]
        for oracle in noises:
            oracle.add(model.get_weights(), window, counts)
        if run.adascale and (
            run.adascale_from_resume and window[-1] < run.resume_at
        ):
            noise.gains.append(1.0)  # a base step, before AdaScale
        elif run.adascale:
            gain = noise.adascale_gain(
                sum(counts) if run.weighted else len(window),
                adascale_base(run),
            )
            optimizer.learning_rate = options["learning_rate"] * gain
        elif run.rule:
            # `S`, the rule's factor at `tau` (the earlier windows' `S`).
            weight = sum(counts) if run.weighted else len(window)
            scale = weight / adascale_base(run)
            factor = rule_factor(run, scale, sum(scales))
            optimizer.learning_rate = options["learning_rate"] * factor
            scales.append(scale)
        rows = np.concatenate([_rows(run, j) for j in window])
        coefficient = np.concatenate(
            [
                weights[_rows(run, j)]
                * (
                    # A window of weight 0: the parent's zero gradient.
                    (1.0 / sum(counts) if sum(counts) else 0.0)
                    if run.weighted
                    else (1.0 / (len(window) * n) if n else 0.0)
                )
                for j, n in zip(window, counts)
            ]
        )
        loss = model.train_on_batch(
            x[rows],
            y[rows],
            sample_weight=(coefficient * len(rows)).astype("float32"),
        )
        losses.append(float(np.ravel(loss)[0]))

    windows, skipped, samples = expected_windows(run, train, noise)
    return {
        "weights": model.get_weights(),
        "iterations": len(windows),
        "skipped": skipped,
        "samples_seen": samples,
        "window_loss": _last_window_loss(run, windows, losses),
        "windowless_updates": sum(
            _windowless_update(run, window) for window in windows
        ),
        "losses": losses,
        "windows": windows,
        "noise": noises,
        "scales": scales,
    }


def _take_dense_gradients(optimizer, dense):
    """Makes the parent `optimizer` apply an embedding's `IndexedSlices`
    gradient made dense where `dense()`: TensorFlow's Adam and RMSprop
    square its slices before adding the rows that repeat, and a window's
    mean is the dense big-batch gradient, as on JAX and torch
    (docs/uneven-batches.md); an optimizer without a window is the parent
    itself."""
    import tensorflow as tf

    apply = optimizer.apply

    def dense_apply(grads, trainable_variables=None):
        if dense():
            grads = [
                tf.convert_to_tensor(g)
                if isinstance(g, tf.IndexedSlices)
                else g
                for g in grads
            ]
        return apply(grads, trainable_variables)

    optimizer.apply = dense_apply


def _last_window_loss(run, windows, losses):
    """The loss of the last window an optimizer with a window closed (0
    before the first)."""
    losses = [
        loss
        for window, loss in zip(windows, losses)
        if not _windowless_update(run, window)
    ]
    return losses[-1] if losses else 0.0


# -- The gradient noise scale -------------------------------------------------

NOISE_READ_OUTS = (
    "noise_scale",
    "gradient_sq_norm",
    "gradient_noise_trace",
    "window_gradient_sq_norm",
    "window_noise_trace",
)
# How far a run's estimates may be from the oracle's, relative to the terms
# they are differences of (`helpers.noise_estimate_scales`), not to the
# estimates (which nearly cancel where the noise dominates): the run's
# micro-batch gradients are at its own weights, the parent's to round-off,
# and it sums their squares in float32. Seen: 1e-7 in float32, 2e-3 under
# mixed_bfloat16 (whose weights are the parent's to a few 16-bit units).
NOISE_RTOL = {"float32": 1e-5, "mixed_float16": 2e-2, "mixed_bfloat16": 2e-2}


class AmbiguousWindow(Exception):
    """The oracle's noise scale is too close to a boundary of
    `by_noise_scale`'s map to say which window a float32 run chooses."""


def ratio_interval(averages, bounds, weight):
    """The interval of `tr(Sigma) / |G|^2` of moving averages `(|G|^2,
    tr(Sigma))` within `bounds` (infinite where `|G|^2 <= 0`); NaNs before
    the first estimate (`weight` 0)."""
    if weight <= 0:
        return (np.nan, np.nan)
    (sq_norm, trace), (sq_bound, trace_bound) = averages, bounds
    if sq_norm - sq_bound > 0:
        corners = [
            (trace + a) / (sq_norm + b)
            for a in (-trace_bound, trace_bound)
            for b in (-sq_bound, sq_bound)
        ]
        return (min(corners), max(corners))
    if sq_norm + sq_bound <= 0:
        return (np.inf, np.inf)
    # |G|^2 within its bound of 0: the ratio is huge, or infinite.
    if trace - trace_bound >= 0:
        return ((trace - trace_bound) / (sq_norm + sq_bound), np.inf)
    return (-np.inf, np.inf)


class NoiseOracle:
    """The noise scale's read-outs of a run, worked out in float64 numpy
    from each window's micro-batch gradients at its starting weights (the
    parent's): each micro-batch's mean gradient is that of its own loss,
    `sum_i w_i l_i / n_j`, of weight `n_j` in weighted windows (1 in
    unweighted ones). Each value comes with a bound on how far the run may
    be from it (`NOISE_RTOL`), so that a comparison is an interval
    and the noise scale's boundaries in `by_noise_scale` are known to be
    clear (`AmbiguousWindow` where they are not)."""

    def __init__(self, run, variables=slice(None)):
        self.run = run
        self.variables = variables  # of the model's weights, those measured
        self.x, self.y, self.w = data(run)
        self.momentum = run.noise_momentum
        self.rtol = NOISE_RTOL[run.policy]
        schedule = run.noise_schedule or {}
        self.warmup = schedule.get("warmup_windows", 0)
        # The moving averages of the estimates (|G|^2, tr(Sigma)), of their
        # bounds, and their total weight; the last window's estimates (0
        # before the first update) and bounds.
        self.averages = np.zeros(2)
        self.bounds = np.zeros(2)
        self.weight = 0.0
        self.window = np.zeros(2)
        self.window_bounds = np.zeros(2)
        # The largest noise scale counted (its interval): a variable that
        # starts at 0.
        self.largest = (0.0, 0.0)
        # The averages, their bounds and weight after each update.
        self.snapshots = []
        self.gains = []  # AdaScale's gain of each update
        self.estimates = 0  # windows that gave an estimate

    def add(self, weights, window, counts):
        """A window closes: `window` its micro-batch indices, `counts`
        what their losses are divided by, `weights` the model's. A
        weighted micro-batch of weight 0 holds no sample: it adds
        nothing."""
        if self.run.weighted:
            kept = [(j, n) for j, n in zip(window, counts) if n > 0]
            window, counts = [j for j, _ in kept], [n for _, n in kept]
        grads = []
        for j, n in zip(window, counts):
            rows = _rows(self.run, j)
            sample = np.ones(len(rows)) if self.w is None else self.w[rows]
            grads.append(
                model_gradients(self.run)(
                    weights, self.x[rows], self.y[rows], sample / (n or 1.0)
                )[self.variables]
            )
        micro_weights = counts if self.run.weighted else [1.0] * len(window)
        self.window = np.asarray(noise_estimates(grads, micro_weights))
        self.window_bounds = self.rtol * np.asarray(
            noise_estimate_scales(grads, micro_weights)
        )
        if len(window) >= 2:
            m = self.momentum
            self.averages = m * self.averages + (1 - m) * self.window
            self.bounds = m * self.bounds + (1 - m) * self.window_bounds
            self.weight = m * self.weight + (1 - m)
            self.estimates += 1
            if self._ready():
                lo, hi = self.noise_scale()
                self.largest = (
                    max(self.largest[0], lo),
                    max(self.largest[1], hi),
                )
        self.snapshots.append((self.averages, self.bounds, self.weight))

    def _ready(self):
        """`noise._accum_noise_ready`: averages of `warmup` windows."""
        if self.warmup <= 0:
            return True
        return self.weight >= (1 - self.momentum**self.warmup) * (1 - 1e-5)

    def noise_scale(self):
        """The interval of `tr(Sigma) / |G|^2` of the averages (infinite
        where `|G|^2 <= 0`); NaNs before the first estimate."""
        return ratio_interval(self.averages, self.bounds, self.weight)

    def adascale_gain(self, window_weight, base):
        """AdaScale's gain of a window of `window_weight` closing now, from
        the averages (`1` before the first estimate), as Johnson et al.
        (2020) define it, clipped to `[1, S]`; recorded in `gains`. A
        window of weight 0 stands for no base step: 0."""
        gain = 1.0
        if window_weight <= 0:
            gain = 0.0
        elif self.weight > 0:
            sq_norm, trace = np.maximum(self.averages / self.weight, 0.0)
            if trace / window_weight + sq_norm > 0:
                gain = (trace / base + sq_norm) / (
                    trace / window_weight + sq_norm
                )
            scale = window_weight / base
            gain = float(np.clip(gain, min(1, scale), max(1, scale)))
        self.gains.append(gain)
        return gain

    def window_size(
        self, micro_batch_size, floor, ceiling, grow_only, warmup_windows
    ):
        """`by_noise_scale`'s window after the windows added so far."""
        if grow_only:
            key = self.largest
        elif self._ready():
            key = self.noise_scale()
        else:
            key = (np.nan, np.nan)

        def size(value):
            if np.isnan(value):
                return floor
            return int(
                np.clip(np.ceil(value / micro_batch_size), floor, ceiling)
            )

        sizes = {size(value) for value in key}
        if len(sizes) > 1:
            raise AmbiguousWindow(
                f"noise scale in {key}: windows {sorted(sizes)} "
                f"(micro_batch_size={micro_batch_size})"
            )
        return sizes.pop()

    def expected(self):
        """`{read-out: (lo, hi)}`, NaNs where the read-out is NaN."""
        nan = (np.nan, np.nan)
        weight = self.weight
        averages = [
            (
                (value - bound) / weight,
                (value + bound) / weight,
            )
            if weight > 0
            else nan
            for value, bound in zip(self.averages, self.bounds)
        ]
        windows = [
            (value - bound, value + bound)
            for value, bound in zip(self.window, self.window_bounds)
        ]
        return dict(
            zip(NOISE_READ_OUTS, [self.noise_scale(), *averages, *windows])
        )


def rule_outcome(run, optimizer):
    """A scaling rule's read-outs after a run: `window_scale` and
    `scale_invariant_step` (nothing without a rule)."""
    if run.rule is None:
        return {}
    names = ("window_scale", "scale_invariant_step")
    return {"rule": [float(to_numpy(getattr(optimizer, n))) for n in names]}


def assert_same_rule(run, ours, parent):
    """A scaling rule's read-outs are the oracle's: the last update's `S`,
    and `tau` their sum (its rates set the parent's learning rates, so
    the weights judge the rule's factors)."""
    scales = parent["scales"]
    np.testing.assert_allclose(
        ours["rule"],
        [scales[-1] if scales else 0.0, sum(scales)],
        rtol=1e-5,
        err_msg="window_scale, scale_invariant_step",
    )


def noise_outcome(run, optimizers, logged):
    """The noise scale's read-outs of each of `optimizers` after a run
    (`"noise"`, the first's; `"noise_of_each"`), and the noise scales a
    logger recorded, `(update, noise_scale)` (nothing where the run does
    not measure it)."""
    if not run.noise:
        return {}
    read_outs = NOISE_READ_OUTS
    if run.adascale:
        read_outs += ("adascale_gain", "scale_invariant_step")
    each = [
        {name: float(to_numpy(getattr(o, name))) for name in read_outs}
        for o in optimizers
    ]
    return {"noise": each[0], "noise_of_each": each, "noise_logged": logged}


def _assert_within(value, interval, what):
    lo, hi = interval
    if np.isnan(lo):
        assert np.isnan(value), f"{what}: {value}, expected NaN"
        return
    atol = 1e-6
    assert lo - atol <= value <= hi + atol, (
        f"{what}: {value}, expected in [{lo:.6g}, {hi:.6g}]"
    )


def assert_same_noise(run, ours, parent):
    """The noise scale's read-outs after the run, and those the logger
    recorded after each update, are the oracle's (`NoiseOracle`): to
    float32 round-off, or a loose `NOISE_RTOL` under the 16-bit policies;
    NaN exactly where the oracle's are (no estimate yet, or a last window
    of one micro-batch)."""
    oracles = parent["noise"]
    assert len(ours["noise_of_each"]) == len(oracles)
    for read_outs, oracle in zip(ours["noise_of_each"], oracles):
        expected = oracle.expected()
        for name in NOISE_READ_OUTS:
            _assert_within(read_outs[name], expected[name], name)
    oracle = oracles[0]
    if run.adascale:
        # The oracle's gains set the parent's learning rates, so the
        # weights judge them too; these are the read-outs.
        np.testing.assert_allclose(
            [
                ours["noise"]["adascale_gain"],
                ours["noise"]["scale_invariant_step"],
            ],
            [oracle.gains[-1] if oracle.gains else 0.0, sum(oracle.gains)],
            rtol=1e-4,
            err_msg="adascale_gain, scale_invariant_step",
        )
    if run.logger:
        # Under a `MultiOptimizer`, the logger's is the ratio of the
        # optimizers' averages summed.
        for update, value in ours["noise_logged"]:
            averages, bounds, weights = zip(
                *(oracle.snapshots[update - 1] for oracle in oracles)
            )
            _assert_within(
                value,
                ratio_interval(sum(averages), sum(bounds), weights[0]),
                f"noise_scale logged at update {update}",
            )


def assert_same_run(run, ours, parent, initial, unchecked=()):
    """Counters exactly (samples to float32), weights and the window loss
    to round-off: float32 round-off relative to how far training moved the
    weights; under the mixed policies a few 16-bit units of it, or 4 times
    the parent's own distance from its float32 run (a weight that barely
    moves, its gradients summed with cancellation, carries round-off far
    above its movement in the parent too). `unchecked` names checks left
    out (`"samples_seen"`, `"window_loss"`, `"logger"`): a known hole."""
    sixteen = run.policy != "float32"
    assert ours["iterations"] == parent["iterations"], "iterations"
    assert ours["skipped"] == parent["skipped"], "skipped_micro_batches"
    if "samples_seen" not in unchecked:
        np.testing.assert_allclose(
            ours["samples_seen"],
            parent["samples_seen"],
            rtol=1e-6,
            err_msg="samples_seen",
        )
    loss_rtol = 3e-2 if sixteen else 1e-4
    if "window_loss" not in unchecked:
        np.testing.assert_allclose(
            ours["window_loss"],
            parent["window_loss"],
            rtol=loss_rtol,
            atol=_loss_atol(run, parent["window_loss"]),
            err_msg="window_loss",
        )
    move_rtol = 5e-2 if sixteen else 1e-3
    twins = parent.get("weights_float32", parent["weights"])
    for n, (a, e, start, twin) in enumerate(
        zip(ours["weights"], parent["weights"], initial, twins)
    ):
        moved = float(np.max(np.abs(e - start)))
        off = float(np.max(np.abs(a - e)))
        own_round_off = float(np.max(np.abs(e - twin)))
        assert off <= max(move_rtol * moved, 4 * own_round_off) + 2e-6, (
            f"weight {n}: {off:.3g} from the parent's, which moved "
            f"{moved:.3g} and is {own_round_off:.3g} from its float32 run"
        )
    if run.logger and "logger" not in unchecked:
        # `fit_to_memory` starts a new `fit` after each recovery, and the
        # logger's `windows` start again there: they end with the last ones.
        updates = [u for u, _ in ours["logged"]]
        first = 1 if isinstance(run, Run) or not updates else updates[0]
        expected = list(range(first, parent["iterations"] + 1))
        if getattr(run, "steps_per_execution", 1) > 1:
            # The logger sees the optimizer between executions: the last
            # update of each (it warns where an execution can apply
            # several).
            assert updates == sorted(set(updates)), updates
            assert set(updates) <= set(expected), updates
            assert not expected or updates[-1:] == expected[-1:], updates
        else:
            assert updates == expected, (
                f"AccumulationLogger recorded updates {updates}"
            )
        windowed = [
            (update, loss)
            for update, loss in ours["logged"]
            if update > parent.get("windowless_updates", 0)
        ]
        if "window_loss" not in unchecked:
            np.testing.assert_allclose(
                [loss for _, loss in windowed],
                [parent["losses"][update - 1] for update, _ in windowed],
                rtol=loss_rtol,
                atol=_loss_atol(run, max(parent["losses"], default=0.0)),
                err_msg="logged window_loss",
            )


# One unit of a 16-bit float, relative to the value.
SIXTEEN_BIT_UNIT = {"mixed_float16": 2.0**-11, "mixed_bfloat16": 2.0**-8}


def _loss_atol(run, loss):
    """How far a window loss of about `loss` may be from the parent's: a
    16-bit prediction is its value to a unit of the format, and the squared
    error of a sample the model nearly fits moves by about 2 |residual| |y|
    unit, a large share of that loss (the two runs' weights differ by the
    16-bit round-off `assert_same_run` allows)."""
    unit = SIXTEEN_BIT_UNIT.get(run.policy)
    if unit is None:
        return 1e-6
    _, y, _ = data(Run(samples=run.samples))
    residual = np.sqrt(y.shape[1] * abs(loss))
    return 2.0 * residual * float(np.max(np.abs(y))) * unit + 1e-6


# -- fit_to_memory ------------------------------------------------------------


@dataclasses.dataclass
class MemoryRun:
    """A drawn `fit_to_memory` run: `rules` are the injected out-of-memory
    errors, `(from_call, above)` as `test_fit_to_memory.Injector` takes
    them, raised before the step or, with `in_backward`, in the middle of
    its backward pass; `micro_batch=None` plans by probes."""

    optimizer: str = "adam"
    target: int = 8
    micro_batch: Optional[int] = 8
    samples: int = 20
    epochs: int = 1
    sample_weight: bool = False
    rules: tuple = ()
    jit_compile: object = "auto"
    logger: bool = False
    policy: str = "float32"
    in_backward: bool = False


def train_ours_to_memory(run, injector_class):
    """`fit_to_memory` with the run's injected errors; its outcome."""
    x, y, w = data(Run(samples=run.samples, sample_weight=run.sample_weight))
    cls, _, options = _options(Run(optimizer=run.optimizer))
    model = make_model()
    if run.in_backward:
        from test_fit_to_memory import tapped_model

        model = tapped_model(model)
    model.compile(
        optimizer=cls(**options), loss="mse", jit_compile=run.jit_compile
    )
    injector = injector_class(model, run.rules, in_backward=run.in_backward)
    logger = ao.AccumulationLogger(update_freq="batch")
    history = ao.fit_to_memory(
        model,
        x,
        y,
        sample_weight=w,
        target_batch_size=run.target,
        micro_batch_size=run.micro_batch,
        epochs=run.epochs,
        shuffle=False,
        verbose=0,
        callbacks=[logger] if run.logger else None,
    )
    logged = zip(logger.windows["updates"], logger.windows["window_loss"])
    return {
        **outcome(model, logged),
        "plan": history.plan,
        "raised": injector.raised,
    }


def train_parent_to_memory(run):
    """The oracle: the parent at `batch_size=target`, windows of `target`
    consecutive samples, each epoch's short last one at its end."""
    x, y, w = data(Run(samples=run.samples, sample_weight=run.sample_weight))
    _, parent_cls, options = _options(Run(optimizer=run.optimizer))
    model = make_model()
    model.compile(
        optimizer=parent_cls(**options), loss="mse", jit_compile=False
    )
    losses = []
    for _ in range(run.epochs):
        for start in range(0, run.samples, run.target):
            rows = slice(start, start + run.target)
            loss = model.train_on_batch(
                x[rows], y[rows], sample_weight=None if w is None else w[rows]
            )
            losses.append(float(np.ravel(loss)[0]))
    return {
        "weights": model.get_weights(),
        "iterations": len(losses),
        "skipped": 0,
        "samples_seen": float(run.samples * run.epochs),  # weighted windows
        "window_loss": losses[-1],
        "losses": losses,
    }
