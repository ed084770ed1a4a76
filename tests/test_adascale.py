"""AdaScale's learning rate (`schedules.adascale`).

Oracles: the gain and the update recomputed in numpy, for every update,
from the window's micro-batch gradients and the noise scale's read-out
averages; the parent SGD on the big batch where the window is the base
batch (`S = 1`); the gain of a linear regression's population, from its
per-sample gradients in numpy, where the noise or the gradient dominates;
an uninterrupted run for a resume.
"""

import keras
import numpy as np
import pytest
from helpers import fit_in_order
from helpers import fit_interrupted
from helpers import regression_data
from helpers import small_model
from helpers import tensorboard_scalars
from helpers import to_numpy

from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import schedules
from accum_optimizers import weigh_micro_batches

SHAPES = ((3, 5), (5,))


def _gain(sq_norm, trace, window_weight, base):
    """AdaScale's gain in float64, as Johnson et al. (2020) define it,
    clipped to `[1, S]`."""
    scale = window_weight / base
    sq_norm, trace = max(sq_norm, 0.0), max(trace, 0.0)
    gain = (trace / base + sq_norm) / (trace / window_weight + sq_norm)
    return float(np.clip(gain, min(1.0, scale), max(1.0, scale)))


def _value(tensor):
    return float(to_numpy(tensor))


def test_each_update_uses_the_gain_times_the_base_rate_at_tau():
    """A custom loop of weighted micro-batches (windows of 3, SGD without
    momentum, an exponentially decaying base rate): each update moves the
    weights by `base(tau) * r` times the window's weighted mean gradient,
    with `r` recomputed from the averages the optimizer reports and `tau`
    the sum of the earlier gains."""
    rng = np.random.default_rng(0)
    variables = [
        keras.Variable(rng.normal(size=s).astype("float32")) for s in SHAPES
    ]
    base = keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5)
    base_batch = 4.0
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(base, base_batch_size=base_batch),
        accum_iters=3,
        measure_noise_scale=True,
        noise_scale_momentum=0.5,
    )
    optimizer.build(variables)
    weights = [to_numpy(v).astype("float64") for v in variables]
    mean = [0.3 * rng.normal(size=s) for s in SHAPES]
    tau, gains = 0.0, []
    for _ in range(6):
        window, counts = [], rng.choice([2.0, 4.0, 7.0], size=3)
        for n in counts:
            grads = [m + rng.normal(size=m.shape) / np.sqrt(n) for m in mean]
            window.append(grads)
            optimizer.apply(
                [keras.ops.convert_to_tensor(g, "float32") for g in grads],
                variables,
                weight=float(n),
            )
        expected_gain = _gain(
            _value(optimizer.gradient_sq_norm),
            _value(optimizer.gradient_noise_trace),
            counts.sum(),
            base_batch,
        )
        np.testing.assert_allclose(
            _value(optimizer.adascale_gain), expected_gain, rtol=1e-5
        )
        rate = float(to_numpy(base(tau))) * expected_gain
        for i, w in enumerate(weights):
            window_mean = np.average([g[i] for g in window], 0, counts)
            weights[i] = w - rate * window_mean
        for variable, w in zip(variables, weights):
            np.testing.assert_allclose(to_numpy(variable), w, rtol=2e-5)
        tau += expected_gain
        gains.append(expected_gain)
        np.testing.assert_allclose(
            _value(optimizer.scale_invariant_step), tau, rtol=1e-6
        )
    # The windows weigh 6 to 21 base batches: the noise makes them count.
    assert max(gains) > 1.5


def _big_batch_run(make_optimizer, batch, x, y):
    model = small_model(0)
    model.compile(optimizer=make_optimizer(), loss="mse")
    return fit_in_order(model, x, y, batch_size=batch, epochs=2)


@pytest.mark.parametrize("accum_iters", [1, 4])
def test_a_window_of_the_base_batch_equals_the_base_run(accum_iters):
    """`S = 1` (the window weighs one base batch): every gain is 1, and the
    run equals the parent SGD (momentum 0.9) with the base schedule on the
    same batches."""
    x, y = regression_data(0, 96)
    micro = 6
    base = keras.optimizers.schedules.ExponentialDecay(0.05, 5, 0.7)
    model = small_model(0)
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(
            base, base_batch_size=micro * accum_iters
        ),
        momentum=0.9,
        accum_iters=accum_iters,
        measure_noise_scale=True,
    )
    model.compile(optimizer=optimizer, loss="mse")
    ours = fit_in_order(model, x, y, weigh=True, batch_size=micro, epochs=2)
    parent = _big_batch_run(
        lambda: keras.optimizers.SGD(learning_rate=base, momentum=0.9),
        micro * accum_iters,
        x,
        y,
    )
    assert _value(optimizer.adascale_gain) == 1.0
    updates = 2 * len(x) // (micro * accum_iters)
    assert _value(optimizer.scale_invariant_step) == updates
    for a, b in zip(ours.get_weights(), parent.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _population(seed, offset, noise, samples=256, features=4):
    """A linear regression, weights `offset` from the truth, targets with
    `noise`: data and the population's `|G|^2` and `tr(Sigma)` of the
    squared error's per-sample gradients at those weights (numpy)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features))
    truth = rng.normal(size=features)
    y = x @ truth + noise * rng.normal(size=samples)
    kernel = truth + offset * rng.normal(size=features)
    residual = x @ kernel - y
    per_sample = 2 * residual[:, None] * x
    mean = per_sample.mean(0)
    trace = ((per_sample - mean) ** 2).sum(1).mean()
    return x, y, kernel, (mean**2).sum(), trace


@pytest.mark.parametrize(
    "offset, noise, batch, regime",
    [(0.02, 2.0, 4, "noise"), (3.0, 0.01, 64, "gradient")],
)
def test_the_gain_tends_to_s_or_to_1_as_the_population_says(
    offset, noise, batch, regime
):
    """At fixed weights (base rate 0), windows of 8 micro-batches of
    `batch` samples against a base batch of `batch` (`S = 8`): the gain
    comes within 10% of the population's; it is near `S` where
    `tr(Sigma) / (S b)` dwarfs `|G|^2` (weights near the optimum of noisy
    targets), near 1 where `|G|^2` dwarfs `tr(Sigma) / b` (far from it,
    with a base batch well above the noise scale)."""
    x, y, kernel, sq_norm, trace = _population(0, offset, noise)
    windows, k = (300 if regime == "noise" else 60), 8
    draws = np.random.default_rng(1).integers(0, len(x), windows * k * batch)
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(1, use_bias=False),
        ]
    )
    model.set_weights([kernel[:, None].astype("float32")])
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(0.0, base_batch_size=batch),
        accum_iters=k,
        measure_noise_scale=True,
        noise_scale_momentum=0.99,
    )
    model.compile(optimizer=optimizer, loss="mse")
    weigh_micro_batches(model)
    model.fit(
        x[draws].astype("float32"),
        y[draws, None].astype("float32"),
        batch_size=batch,
        shuffle=False,
        verbose=0,
    )
    expected = _gain(sq_norm, trace, k * batch, batch)
    if regime == "noise":
        assert expected > 0.9 * k
    else:
        assert expected < 1.1
    np.testing.assert_allclose(
        _value(optimizer.adascale_gain), expected, rtol=0.1
    )


WINDOWS = {
    "by_noise_scale": lambda: schedules.by_noise_scale(4, floor=2, ceiling=6),
    "by_samples": lambda: schedules.by_samples({0: 2, 40: 3, 120: 5}),
}


def _adascale_sgd(windows="by_noise_scale"):
    model = small_model(3)
    model.compile(
        optimizer=SGDAccumulate(
            learning_rate=schedules.adascale(
                keras.optimizers.schedules.CosineDecay(0.05, 40),
                base_batch_size=4,
            ),
            momentum=0.9,
            accum_iters=WINDOWS[windows](),
            measure_noise_scale=True,
            noise_scale_momentum=0.8,
        ),
        loss="mse",
    )
    weigh_micro_batches(model)
    return model


@pytest.mark.parametrize("windows", list(WINDOWS))
def test_a_keras_file_saved_mid_window_resumes_exactly(windows, tmp_path):
    """The scale-invariant step and the gain are saved state: a run saved
    mid-window to a `.keras` file and resumed ends as the uninterrupted
    run, `tau` included, with windows sized by the noise scale or keyed on
    samples."""
    x, y = regression_data(4, 200)
    split = 4 * 21  # 21 micro-batches: mid-window
    whole, first = fit_interrupted(
        lambda: _adascale_sgd(windows), x, y, split, 4
    )
    path = tmp_path / "model.keras"
    first.save(path)
    resumed = keras.models.load_model(path)
    weigh_micro_batches(resumed)
    fit_in_order(resumed, x[split:], y[split:], batch_size=4)
    assert _value(whole.optimizer.scale_invariant_step) > int(
        to_numpy(whole.optimizer.iterations)
    )
    for what in ("scale_invariant_step", "adascale_gain"):
        np.testing.assert_allclose(
            _value(getattr(resumed.optimizer, what)),
            _value(getattr(whole.optimizer, what)),
            rtol=1e-6,
        )
    for a, b in zip(resumed.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("parent_rate", ["schedule", "float"])
def test_a_state_saved_without_adascale_continues_the_base_schedule(
    parent_rate,
):
    """The parent SGD's state (no window) loaded into an AdaScale
    optimizer: each update it applied was one base step. A float rate the
    parent saved is AdaScale's base rate's to replace."""
    variables = [keras.Variable(np.ones(s, "float32")) for s in SHAPES]
    base = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    parent = keras.optimizers.SGD(
        learning_rate=base if parent_rate == "schedule" else 0.3,
        momentum=0.9,
    )
    parent.build(variables)
    for _ in range(5):
        parent.apply([keras.ops.ones(s) for s in SHAPES], variables)
    store = {}
    parent.save_own_variables(store)
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(base, base_batch_size=1),
        momentum=0.9,
        accum_iters=2,
        measure_noise_scale=True,
    )
    optimizer.build(variables)
    optimizer.load_own_variables(store)
    assert _value(optimizer.scale_invariant_step) == 5.0
    assert _value(optimizer.adascale_gain) == 1.0
    assert _value(optimizer.learning_rate) == pytest.approx(
        float(to_numpy(base(5.0)))
    )


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: AdamAccumulate(
                learning_rate=schedules.adascale(1e-3, 8),
                measure_noise_scale=True,
            ),
            ValueError,
            "takes an SGD optimizer.*AdamAccumulate",
        ),
        (
            lambda: SGDAccumulate(learning_rate=schedules.adascale(0.1, 8)),
            ValueError,
            "measure_noise_scale=False",
        ),
        (
            lambda: schedules.adascale(0.1, base_batch_size=0),
            ValueError,
            "base_batch_size=0",
        ),
        (
            lambda: schedules.adascale(float("nan"), base_batch_size=8),
            ValueError,
            "learning_rate=nan",
        ),
        (
            lambda: schedules.adascale(
                schedules.by_samples(
                    keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
                ),
                base_batch_size=8,
            ),
            TypeError,
            "keyed on updates",
        ),
        (
            lambda: keras.optimizers.SGD(schedules.adascale(0.1, 8)).apply(
                [keras.ops.ones((2,))], [keras.Variable(np.ones(2))]
            ),
            TypeError,
            "not of a plain Keras optimizer",
        ),
    ],
)
def test_what_it_refuses_is_named(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_it_cannot_stop_measuring_and_round_trips_its_config():
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(
            keras.optimizers.schedules.CosineDecay(0.1, 100), 16
        ),
        accum_iters=4,
        measure_noise_scale=True,
    )
    with pytest.raises(ValueError, match="measure_noise_scale=False"):
        optimizer.measure_noise_scale = False
    config = keras.optimizers.serialize(optimizer)
    again = keras.optimizers.deserialize(config)
    learning_rate = again._learning_rate
    assert isinstance(learning_rate, schedules.AdaScaleLearningRate)
    assert learning_rate.base_batch_size == 16
    assert learning_rate.get_config() == optimizer._learning_rate.get_config()


def test_the_logger_reads_out_the_gain_and_tau(tmp_path):
    """`AccumulationLogger` adds both to `fit`'s logs, `History`, its
    per-update record and TensorBoard (step = applied updates); `tau` is
    the running sum of the recorded gains."""
    x, y = regression_data(4, 48)
    model = _adascale_sgd()
    logger = AccumulationLogger(log_dir=tmp_path, update_freq="batch")
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    optimizer = model.optimizer
    tau = _value(optimizer.scale_invariant_step)
    assert history.history["scale_invariant_step"][-1] == tau
    gains = logger.windows["adascale_gain"]
    assert len(gains) == int(to_numpy(optimizer.iterations))
    np.testing.assert_allclose(
        np.cumsum(gains), logger.windows["scale_invariant_step"], rtol=1e-5
    )
    scalars = tensorboard_scalars(tmp_path / "train")
    _, written = scalars["accumulation/scale_invariant_step"][-1]
    assert written == pytest.approx(tau)


class _ReadOuts(keras.callbacks.Callback):
    """The noise scale's averages and AdaScale's read-outs after each
    micro-batch."""

    def __init__(self):
        super().__init__()
        self.after = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.after.append(
            {
                name: _value(getattr(optimizer, name))
                for name in (
                    "gradient_sq_norm",
                    "gradient_noise_trace",
                    "adascale_gain",
                    "scale_invariant_step",
                )
            }
        )


def test_a_window_of_weight_0_is_a_step_of_rate_0():
    """A window whose sample weights are all 0 (`mean_with_sample_weight`)
    holds no sample: `S = 0`, its gain is 0, `tau` does not move, and its
    update is the parent's at learning rate 0 (no weight decay; SGD's
    momentum carries on); the next window's gain is its own. Oracle: the
    parent SGD on each window's big batch, its rate the base rate times
    the gain recomputed in numpy from the averages the optimizer reports
    (0 where the window weighs 0, the documented rule)."""
    x, y = regression_data(5, 32)
    sample_weight = np.random.default_rng(5).choice([0.5, 1.0, 3.0], 32)
    sample_weight[8:16] = 0.0  # the second window: 2 micro-batches of 4
    sample_weight = sample_weight.astype("float32")
    micro, base_rate, base_batch = 4, 0.5, 4.0
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    options = {"momentum": 0.9, "weight_decay": 0.05}
    model = small_model(2)
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(base_rate, base_batch),
        accum_iters=2,
        measure_noise_scale=True,
        noise_scale_momentum=0.5,
        **options,
    )
    model.compile(optimizer=optimizer, loss=loss)
    weigh_micro_batches(model)
    read_outs = _ReadOuts()
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=micro,
        shuffle=False,
        verbose=0,
        callbacks=[read_outs],
    )
    parent = small_model(2)
    parent_optimizer = keras.optimizers.SGD(base_rate, **options)
    parent.compile(optimizer=parent_optimizer, loss=loss)
    tau, gains = 0.0, []
    for window in range(4):
        rows = slice(2 * micro * window, 2 * micro * (window + 1))
        weight = float(sample_weight[rows].sum())
        after = read_outs.after[2 * window + 1]
        gain = 0.0
        if weight > 0:
            gain = _gain(
                after["gradient_sq_norm"],
                after["gradient_noise_trace"],
                weight,
                base_batch,
            )
        parent_optimizer.learning_rate = base_rate * gain
        parent.train_on_batch(
            x[rows], y[rows], sample_weight=sample_weight[rows]
        )
        tau += gain
        gains.append(gain)
        np.testing.assert_allclose(
            [after["adascale_gain"], after["scale_invariant_step"]],
            [gain, tau],
            rtol=1e-5,
            err_msg=f"window {window}",
        )
    assert gains[1] == 0.0 and min(gains[2:]) > 1.0
    for a, b in zip(model.get_weights(), parent.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _weighted_micro_batches(optimizer, variables, rng, mean, counts):
    """Applies a micro-batch of each weight in `counts` (gradients drawn
    about `mean`); returns their gradients, in float64."""
    applied = []
    for n in counts:
        grads = [m + rng.normal(size=m.shape) / np.sqrt(n) for m in mean]
        applied.append(grads)
        optimizer.apply(
            [keras.ops.convert_to_tensor(g, "float32") for g in grads],
            variables,
            weight=float(n),
        )
    return applied


def test_adascale_turned_on_from_a_state_saved_without_it():
    """A state saved mid-window by the same optimizer without AdaScale (a
    float rate: 22 variables against 25 here) loads into an AdaScale one
    by `load_own_variables`: `tau` is the updates applied, each a base
    step, the pending micro-batch and the noise scale's averages carry
    on, and each later update is `base(tau) * r` times the window's mean
    (numpy, `r` from the averages the optimizer reports)."""
    rng = np.random.default_rng(7)
    variables = [
        keras.Variable(rng.normal(size=s).astype("float32")) for s in SHAPES
    ]
    weights = [to_numpy(v).astype("float64") for v in variables]
    mean = [0.3 * rng.normal(size=s) for s in SHAPES]
    measuring = {"measure_noise_scale": True, "noise_scale_momentum": 0.5}
    before = SGDAccumulate(learning_rate=0.1, accum_iters=3, **measuring)
    before.build(variables)
    counts = [2.0, 4.0, 7.0] * 2 + [3.0]
    applied = _weighted_micro_batches(before, variables, rng, mean, counts)
    for first in (0, 3):
        for i, w in enumerate(weights):
            window = [g[i] for g in applied[first : first + 3]]
            weights[i] = w - 0.1 * np.average(window, 0, counts[first:][:3])
    store = {}
    before.save_own_variables(store)
    base = keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5)
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(base, base_batch_size=2.0),
        accum_iters=3,
        **measuring,
    )
    optimizer.build(variables)
    assert len(store) == len(optimizer.variables) - 2  # 3 less, and a rate
    optimizer.load_own_variables(store)
    tau = 2.0
    assert _value(optimizer.scale_invariant_step) == tau
    assert _value(optimizer.adascale_gain) == 1.0
    window, weight = [applied[-1]], [counts[-1]]  # the pending one
    for size in (2, 3):
        more = list(rng.choice([2.0, 4.0, 7.0], size=size))
        window += _weighted_micro_batches(optimizer, variables, rng, mean, more)
        weight += more
        gain = _gain(
            _value(optimizer.gradient_sq_norm),
            _value(optimizer.gradient_noise_trace),
            float(np.sum(weight)),
            2.0,
        )
        rate = float(to_numpy(base(tau))) * gain
        for i, w in enumerate(weights):
            mean_gradient = np.average([g[i] for g in window], 0, weight)
            weights[i] = w - rate * mean_gradient
        tau += gain
        window, weight = [], []
        for variable, w in zip(variables, weights):
            np.testing.assert_allclose(to_numpy(variable), w, rtol=2e-5)
        np.testing.assert_allclose(
            _value(optimizer.scale_invariant_step), tau, rtol=1e-6
        )
    assert gain > 1.5


def test_a_state_it_cannot_take_is_refused_naming_adascale():
    variables = [keras.Variable(np.ones(s, "float32")) for s in SHAPES]
    saved = SGDAccumulate(0.1, accum_iters=2, measure_noise_scale=True)
    saved.build(variables)
    saved.apply([keras.ops.ones(s) for s in SHAPES], variables)
    store = {}
    saved.save_own_variables(store)
    optimizer = SGDAccumulate(
        learning_rate=schedules.adascale(0.1, base_batch_size=1),
        momentum=0.9,
        accum_iters=2,
        measure_noise_scale=True,
    )
    optimizer.build(variables)
    with pytest.raises(ValueError, match="momentum.*AdaScale learning rate"):
        optimizer.load_own_variables(store)


@pytest.mark.parametrize("mapped_by", ["map", "function"])
def test_a_multi_optimizer_of_several_refuses_it_by_name(mapped_by):
    """Each optimizer of a `MultiOptimizer` measures only its own
    variables, where AdaScale's gain is the model's: `fit` raises, naming
    both, before anything moves."""
    x, y = regression_data(1, 16)

    def multi_optimizer():
        scaled = SGDAccumulate(
            learning_rate=schedules.adascale(0.1, base_batch_size=4),
            accum_iters=2,
            measure_noise_scale=True,
        )
        other = SGDAccumulate(0.1, accum_iters=2, measure_noise_scale=True)
        if mapped_by == "function":
            return keras.optimizers.MultiOptimizer(
                lambda v: other if "bias" in v.path else scaled
            )
        return keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(scaled, {".*bias": other})
        )

    model = small_model(1)
    model.compile(optimizer=multi_optimizer(), loss="mse")
    with pytest.raises(ValueError, match="MultiOptimizer '.*AdaScale"):
        model.fit(x, y, batch_size=4, verbose=0)
    # A custom loop's `apply`: refused before anything is written. (On
    # JAX, Keras' trainer leaves a model whose traced step raised without
    # values.)
    variables = [
        keras.Variable(np.ones(s, "float32"), name=name)
        for s, name in zip(SHAPES, ("kernel", "bias"))
    ]
    with pytest.raises(ValueError, match="'sgd_accumulate.*adascale"):
        multi_optimizer().apply([keras.ops.ones(s) for s in SHAPES], variables)
    for variable in variables:
        np.testing.assert_array_equal(to_numpy(variable), 1.0)
