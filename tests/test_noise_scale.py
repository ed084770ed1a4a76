"""The gradient noise scale measured by the window (`measure_noise_scale`).

Oracles: each window's two unbiased estimates recomputed in float64 numpy
from the micro-batch gradients the test generates (and the moving averages
and their ratio from those); the population's `|G|^2`, `tr(Sigma)` and
`B_simple` of a linear regression at fixed weights, computed from its
per-sample gradients in numpy. (`by_noise_scale`: test_noise_schedule.py;
under distribution: test_distribution_jax.py, test_distribution_torch.py,
test_noise_scale_distributed.py.)
"""

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import parent_on_window_means
from helpers import regression_data
from helpers import small_model
from helpers import tensorboard_scalars
from helpers import to_numpy
from modes import MODES
from modes import applier

from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import schedules
from accum_optimizers import weigh_micro_batches

SHAPES = ((3, 5), (5,), (5, 2), (2,))  # a small MLP's kernels and biases


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    return [
        keras.Variable(rng.normal(size=s).astype("float32")) for s in SHAPES
    ]


def _micro_batches(seed, count):
    rng = np.random.default_rng(seed)
    # A common mean plus noise: |G|^2 and tr(Sigma) both matter.
    mean = [rng.normal(size=s) for s in SHAPES]
    return [
        [
            (m + rng.normal(size=s)).astype("float32")
            for m, s in zip(mean, SHAPES)
        ]
        for _ in range(count)
    ]


def _estimates(window, weights):
    """The paper's two unbiased estimates from one window, in float64:
    `(|G|^2, tr(Sigma))`, or NaNs for a window of one micro-batch."""
    weights = np.asarray(weights, "float64")
    if len(window) < 2:
        return np.nan, np.nan
    sq_norms = [
        sum((g.astype("float64") ** 2).sum() for g in s) for s in window
    ]
    small = np.mean(sq_norms)
    big_batch = weights.sum()
    small_batch = len(window) / (1.0 / weights).sum()
    mean = [
        sum(w * s[i].astype("float64") for w, s in zip(weights, window))
        / big_batch
        for i in range(len(SHAPES))
    ]
    big = sum((m**2).sum() for m in mean)
    sq_norm = (big_batch * big - small_batch * small) / (
        big_batch - small_batch
    )
    trace = (small - big) / (1 / small_batch - 1 / big_batch)
    return sq_norm, trace


def _value(tensor):
    return float(to_numpy(tensor))


def _assert_close(actual, expected, what):
    if np.isnan(expected):
        assert np.isnan(actual), (what, actual)
    else:
        np.testing.assert_allclose(actual, expected, rtol=2e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_each_window_s_estimates_are_the_paper_s_from_its_micro_batches(
    mode, weighted
):
    """Windows of 3 with a skipped micro-batch and uneven weights, then a
    flushed window of one (no estimate): each window's estimates, their
    moving averages and `noise_scale` against numpy."""
    momentum = 0.8
    optimizer = SGDAccumulate(
        learning_rate=0.05,
        accum_iters=3,
        skip_nonfinite=True,
        measure_noise_scale=True,
        noise_scale_momentum=momentum,
    )
    variables = _variables()
    step = applier(optimizer, variables, mode)
    steps = _micro_batches(1, 10)
    steps[4][2].flat[3] = np.nan  # skipped: adds nothing to its window
    rng = np.random.default_rng(2)
    weights = [float(rng.integers(1, 9)) if weighted else None for _ in steps]
    kept = [n for n in range(10) if n != 4]
    windows = [kept[0:3], kept[3:6], kept[6:9]]
    averages, total = np.zeros(2), 0.0
    for window in windows:
        for n in window + ([4] if window is windows[1] else []):
            step(steps[n], weights[n])
        counted = [1.0 if weights[n] is None else weights[n] for n in window]
        expected = _estimates([steps[n] for n in window], counted)
        _assert_close(_value(optimizer.window_gradient_sq_norm), expected[0], 1)
        _assert_close(_value(optimizer.window_noise_trace), expected[1], 2)
        averages = momentum * averages + (1 - momentum) * np.asarray(expected)
        total = momentum * total + (1 - momentum)
        np.testing.assert_allclose(
            [
                _value(optimizer.gradient_sq_norm),
                _value(optimizer.gradient_noise_trace),
            ],
            averages / total,
            rtol=2e-4,
            atol=1e-4,
        )
        np.testing.assert_allclose(
            _value(optimizer.noise_scale), averages[1] / averages[0], rtol=5e-4
        )
    # The weights moved as the parent's on the windows' means.
    reference = _variables()
    parent_on_window_means(
        keras.optimizers.SGD(0.05),
        reference,
        [[steps[n] for n in w] for w in windows],
        [[weights[n] for n in w] for w in windows],
    )
    assert_all_close(variables, reference, rtol=1e-5, atol=1e-6)
    if mode == "eager":
        step(steps[0], weights[0])
        optimizer.flush()  # a window of one micro-batch: no estimate
        assert np.isnan(_value(optimizer.window_gradient_sq_norm))
        assert np.isnan(_value(optimizer.window_noise_trace))
        np.testing.assert_allclose(
            _value(optimizer.noise_scale), averages[1] / averages[0], rtol=5e-4
        )


def _linear_regression(seed=0, samples=256, features=4):
    """Data, fixed weights away from the optimum, and the population's
    `|G|^2` and `tr(Sigma)` of the per-sample gradients of the squared
    error at those weights (numpy, float64)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features))
    truth = rng.normal(size=features)
    y = x @ truth + 0.5 * rng.normal(size=samples)
    kernel = truth + 0.6 * rng.normal(size=features)
    bias = 0.3
    residual = x @ kernel + bias - y
    per_sample = (
        2 * residual[:, None] * np.concatenate([x, np.ones((samples, 1))], 1)
    )
    mean = per_sample.mean(0)
    trace = ((per_sample - mean) ** 2).sum(1).mean()
    return x, y, kernel, bias, (mean**2).sum(), trace


def test_running_estimates_converge_to_the_population_s():
    """`fit` (weighted windows of 4 micro-batches of 8 samples drawn with
    replacement, learning rate 0 so the weights stay put): the running
    estimates approach the population's |G|^2, tr(Sigma) and B_simple.
    Over 600 windows numpy simulations of the same estimator scatter by
    about 2.5% (one standard deviation); the tolerance is 10%."""
    x, y, kernel, bias, sq_norm, trace = _linear_regression()
    windows, k, batch = 600, 4, 8
    draws = np.random.default_rng(1).integers(0, len(x), windows * k * batch)
    model = keras.Sequential(
        [keras.Input((x.shape[1],)), keras.layers.Dense(1)]
    )
    model.set_weights([kernel[:, None].astype("float32"), np.float32([bias])])
    optimizer = SGDAccumulate(
        learning_rate=0.0,
        accum_iters=k,
        measure_noise_scale=True,
        noise_scale_momentum=0.999,
    )
    model.compile(optimizer=optimizer, loss="mse")
    weigh_micro_batches(model)  # B_simple in samples
    model.fit(
        x[draws].astype("float32"),
        y[draws, None].astype("float32"),
        batch_size=batch,
        shuffle=False,
        verbose=0,
    )
    assert int(to_numpy(optimizer.iterations)) == windows
    np.testing.assert_allclose(
        _value(optimizer.gradient_sq_norm), sq_norm, rtol=0.1
    )
    np.testing.assert_allclose(
        _value(optimizer.gradient_noise_trace), trace, rtol=0.1
    )
    np.testing.assert_allclose(
        _value(optimizer.noise_scale), trace / sq_norm, rtol=0.1
    )


def test_a_state_saved_without_the_measurement_resumes_with_it():
    """Today's layout before the noise scale's variables (as
    `measure_noise_scale=False` still saves it), mid-window, loaded into an
    optimizer that measures: the window continues exactly; the window it
    was saved in gives no estimate (its first micro-batches were not
    measured), the next one does."""
    steps = _micro_batches(3, 8)
    old = AdamAccumulate(learning_rate=0.1, accum_iters=3)
    old_variables = _variables()
    old.build(old_variables)
    for grads in steps[:4]:
        old.apply(grads, old_variables)
    saved = {str(i): to_numpy(v) for i, v in enumerate(old.variables)}
    new = AdamAccumulate(
        learning_rate=0.1, accum_iters=3, measure_noise_scale=True
    )
    variables = _variables()
    for variable, value in zip(variables, old_variables):
        variable.assign(to_numpy(value))
    new.build(variables)
    assert len(new.variables) == len(saved) + 9
    new.load_own_variables(saved)
    assert int(to_numpy(new.micro_steps)) == 1
    for grads in steps[4:]:
        old.apply(grads, old_variables)
        new.apply(grads, variables)
        if int(to_numpy(new.iterations)) == 2:
            assert np.isnan(_value(new.window_gradient_sq_norm))
    assert_all_close(variables, old_variables, rtol=1e-6, atol=1e-7)
    assert int(to_numpy(new.iterations)) == 2
    assert np.isnan(_value(new.noise_scale))
    new.apply(steps[0], variables)  # closes a whole measured window
    expected = _estimates([steps[6], steps[7], steps[0]], [1.0, 1.0, 1.0])
    _assert_close(_value(new.window_noise_trace), expected[1], "trace")
    # And its own state, saved mid-window and loaded, round-trips.
    new.apply(steps[1], variables)
    store = {str(i): to_numpy(v) for i, v in enumerate(new.variables)}
    again = AdamAccumulate(
        learning_rate=0.1, accum_iters=3, measure_noise_scale=True
    )
    again.build(_variables())
    again.load_own_variables(store)
    for ours, theirs in zip(again.variables, new.variables):
        np.testing.assert_array_equal(to_numpy(ours), to_numpy(theirs))


def test_only_optimizers_that_measure_carry_the_variables():
    plain = AdamAccumulate(accum_iters=2)
    measuring = AdamAccumulate(accum_iters=2, measure_noise_scale=True)
    plain.build(_variables())
    measuring.build(_variables())
    assert len(measuring.variables) == len(plain.variables) + 9
    assert np.isnan(_value(plain.noise_scale))
    config = measuring.get_config()
    assert config["measure_noise_scale"] is True
    assert config["noise_scale_momentum"] == 0.99
    rebuilt = AdamAccumulate.from_config(config)
    assert rebuilt.measure_noise_scale is True


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"measure_noise_scale": 1}, "measure_noise_scale=1"),
        ({"noise_scale_momentum": 1.0}, "noise_scale_momentum=1.0"),
        ({"noise_scale_momentum": -0.1}, "noise_scale_momentum=-0.1"),
        (
            {"accum_iters": schedules.by_noise_scale(8)},
            "measure_noise_scale=False",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AdamAccumulate(**arguments)


@pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)
def test_a_multi_optimizer_s_inner_optimizers_each_measure_their_own():
    """Each inner optimizer measures the gradients of its own variables;
    the logger sums their components, whose ratio is the model's."""
    kernel = keras.Variable(np.ones((3, 5), "float32"), name="kernel")
    bias = keras.Variable(np.zeros((5,), "float32"), name="bias")
    inner = [
        SGDAccumulate(0.1, accum_iters=3, measure_noise_scale=True),
        AdamAccumulate(0.05, accum_iters=3, measure_noise_scale=True),
    ]
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(inner[0], {".*bias": inner[1]})
    )
    steps = [s[:2] for s in _micro_batches(7, 3)]
    for grads in steps:
        multi.apply(
            [keras.ops.convert_to_tensor(g) for g in grads], [kernel, bias]
        )
    for i, optimizer in enumerate(inner):
        alone = [[s[i]] for s in steps]
        sq_norm, trace = _estimates_of(alone)
        _assert_close(_value(optimizer.window_noise_trace), trace, i)
        _assert_close(_value(optimizer.window_gradient_sq_norm), sq_norm, i)
    # The components add over variables: their sums' ratio is the model's.
    sq_norm, trace = _estimates_of(steps)
    summed = [
        sum(_value(o.gradient_sq_norm) for o in inner),
        sum(_value(o.gradient_noise_trace) for o in inner),
    ]
    np.testing.assert_allclose(summed, [sq_norm, trace], rtol=5e-4)


def _estimates_of(window):
    """`_estimates` for micro-batches of weight 1 holding any variables."""
    sq_norms = [
        sum((g.astype("float64") ** 2).sum() for g in s) for s in window
    ]
    small = np.mean(sq_norms)
    mean = [np.mean([s[i] for s in window], 0) for i in range(len(window[0]))]
    big = sum((m.astype("float64") ** 2).sum() for m in mean)
    m = len(window)
    return (m * big - small) / (m - 1), (small - big) / (1 - 1 / m)


def test_the_logger_writes_the_noise_scale_to_history_and_tensorboard(
    tmp_path,
):
    x, y = regression_data(4, 48)
    model = small_model(0)
    optimizer = AdamAccumulate(accum_iters=3, measure_noise_scale=True)
    model.compile(optimizer=optimizer, loss="mse")
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
    assert history.history["noise_scale"][-1] == _value(optimizer.noise_scale)
    assert len(logger.windows["noise_scale"]) == 8  # one per update
    points = [
        (step, value)
        for step, value in tensorboard_scalars(tmp_path / "train")[
            "accumulation/noise_scale"
        ]
        if step > 0  # (the first batch's point, before any update)
    ]
    assert [step for step, _ in points] == list(range(1, 9))
    np.testing.assert_allclose(
        [value for _, value in points],
        logger.windows["noise_scale"],
        rtol=1e-6,
    )


def test_an_optimizer_built_without_the_measurement_refuses_it_later():
    optimizer = AdamAccumulate(accum_iters=2)
    optimizer.build(_variables())
    with pytest.raises(ValueError, match="measure_noise_scale=True"):
        optimizer.measure_noise_scale = True


def test_a_micro_batch_of_weight_0_is_no_sample():
    """`fit` with `weigh_micro_batches`: a micro-batch whose sample weights
    are all 0 weighs 0 and adds nothing to the window's estimates (it
    made them NaN), which are those of the other micro-batches, from their
    gradients at the window's weights in numpy."""
    x, y = regression_data(5, 12)
    sample_weight = np.array([1, 2, 0.5, 1] + [0] * 4 + [3, 1, 1, 2], "float32")
    model = small_model(0)
    start = model.get_weights()
    model.compile(
        optimizer=SGDAccumulate(0.1, accum_iters=3, measure_noise_scale=True),
        loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
    )
    weigh_micro_batches(model)
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=4,
        shuffle=False,
        verbose=0,
    )
    window, weights = [], []
    for batch in (slice(0, 4), slice(8, 12)):
        weight = sample_weight[batch]
        window.append(_mse_gradients(start, x[batch], y[batch], weight))
        weights.append(float(weight.sum()))
    expected = _estimates(window, weights)
    optimizer = model.optimizer
    _assert_close(_value(optimizer.window_gradient_sq_norm), expected[0], 1)
    _assert_close(_value(optimizer.window_noise_trace), expected[1], 2)


def _mse_gradients(weights, x, y, sample_weight):
    """The gradients of `small_model`'s `mean_with_sample_weight` MSE at
    `weights` (kernel, bias, kernel, bias), in float64 numpy."""
    w1, b1, w2, b2 = (np.asarray(w, "float64") for w in weights)
    hidden = np.tanh(x @ w1 + b1)
    out = hidden @ w2 + b2
    d_out = (
        2
        * sample_weight[:, None]
        * (out - y)
        / (y.shape[1] * sample_weight.sum())
    )
    d_z = (d_out @ w2.T) * (1 - hidden**2)
    return [x.T @ d_z, d_z.sum(0), hidden.T @ d_out, d_out.sum(0)]
