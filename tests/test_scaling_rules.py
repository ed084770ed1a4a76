"""The scaling rules' learning rates (`schedules.linear_scaling`,
`schedules.sqrt_scaling`), for any optimizer.

Oracles: the parent Keras optimizer on each window's big batch, its
learning rate set before each update to the rule's rate recomputed in
numpy (the base schedule's formula at `tau`, the rule's factor of `S`,
`tau` the sum of the earlier windows' `S`); the parent with the base
schedule where the window is the base batch (`S = 1`); an uninterrupted
run for a resume.
"""

import keras
import numpy as np
import pytest
from helpers import fit_in_order
from helpers import fit_interrupted
from helpers import regression_data
from helpers import small_model
from helpers import to_numpy

from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import schedules
from accum_optimizers import weigh_micro_batches

BACKEND = keras.backend.backend()
# The base run's schedule, and its formula: `0.05 * 0.5 ** (step / 4)`.
BASE_RATE, DECAY_STEPS, DECAY_RATE = 0.05, 4, 0.5


def _base_schedule():
    return keras.optimizers.schedules.ExponentialDecay(
        BASE_RATE, DECAY_STEPS, DECAY_RATE
    )


def _base_rate(tau):
    return BASE_RATE * DECAY_RATE ** (tau / DECAY_STEPS)


def _factor(rule, scale, tau):
    """The rule's factor, as the docs define it (float64)."""
    name, warmup = rule
    if name == "sqrt":
        return np.sqrt(scale)
    if warmup == 0 or scale <= 1:
        return scale
    return 1 + (scale - 1) * min(1.0, tau / warmup)


def _rule(rule, base_batch_size, learning_rate=None):
    name, warmup = rule
    learning_rate = learning_rate or _base_schedule()
    if name == "sqrt":
        return schedules.sqrt_scaling(learning_rate, base_batch_size)
    return schedules.linear_scaling(
        learning_rate, base_batch_size, warmup_steps=warmup
    )


def _value(tensor):
    return float(to_numpy(tensor))


# (rule, accumulating class, parent class, options, compile options):
# Adam, SGD with momentum and weight decay, RMSprop; the train step as
# Keras compiles it, XLA (JAX's jit), eager.
CASES = {
    "linear_warmup_adam": (
        ("linear", 3.0),
        AdamAccumulate,
        keras.optimizers.Adam,
        {},
        {},
    ),
    "sqrt_sgd": (
        ("sqrt", 0),
        SGDAccumulate,
        keras.optimizers.SGD,
        {"momentum": 0.9, "weight_decay": 0.05},
        {"jit_compile": BACKEND != "torch"},
    ),
    "linear_rmsprop": (
        ("linear", 0),
        RMSpropAccumulate,
        keras.optimizers.RMSprop,
        {},
        {"run_eagerly": True},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_update_takes_the_rule_s_rate_on_the_base_run_s_clock(case):
    """Two epochs of 10 weighted micro-batches of 4 (sample weights, under
    `mean_with_sample_weight`), windows of 2 then 4 (`accum_iters={0: 2,
    2: 4}`), a short window flushed at each epoch's end, and a window of
    weight 0 (micro-batches 2 and 3: `S = 0`, rate 0, `tau` stays): each
    update equals the parent's on the window's big batch at the rule's
    rate recomputed in numpy, and `window_scale`, `scale_invariant_step`
    and the learning rate read between windows are the oracle's."""
    rule, cls, parent_cls, options, compiled = CASES[case]
    x, y = regression_data(6, 40)
    sample_weight = np.random.default_rng(6).choice([0.5, 1.0, 3.0], 40)
    sample_weight[8:16] = 0.0
    sample_weight = sample_weight.astype("float32")
    micro, base_batch = 4, 6.0
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    model = small_model(2)
    optimizer = cls(
        learning_rate=_rule(rule, base_batch),
        accum_iters={0: 2, 2: 4},
        **options,
    )
    model.compile(optimizer=optimizer, loss=loss, **compiled)
    read_outs = []

    class ReadOuts(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            optimizer = self.model.optimizer  # (JAX: syncs the state)
            read_outs.append(
                [
                    _value(optimizer.window_scale),
                    _value(optimizer.scale_invariant_step),
                    _value(optimizer.learning_rate),
                ]
            )

    fit_in_order(
        model,
        x,
        y,
        weigh=True,
        sample_weight=sample_weight,
        batch_size=micro,
        epochs=2,
        callbacks=[ReadOuts(), FlushAccumulation()],
    )
    parent = small_model(2)
    parent_optimizer = parent_cls(learning_rate=1.0, **options)
    parent.compile(optimizer=parent_optimizer, loss=loss)
    # Micro-batches of each window, the last ones flushed short.
    windows = [[0, 1], [2, 3], [4, 5, 6, 7], [8, 9]]
    windows += [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    tau, scales = 0.0, []
    for update, window in enumerate(windows):
        rows = np.concatenate(
            [np.arange(micro * j, micro * (j + 1)) for j in window]
        )
        scale = float(sample_weight[rows].sum()) / base_batch
        parent_optimizer.learning_rate = _factor(rule, scale, tau) * (
            _base_rate(tau)
        )
        parent.train_on_batch(
            x[rows], y[rows], sample_weight=sample_weight[rows]
        )
        tau += scale
        scales.append(scale)
        # After the window's last micro-batch (the flush comes after it
        # at an epoch's end: read at the next epoch's or the run's end).
        if window[-1] != 9:
            after = read_outs[10 * (update // 4) + window[-1]]
            np.testing.assert_allclose(
                after,
                [scale, tau, _factor(rule, scale, tau) * _base_rate(tau)],
                rtol=1e-5,
                err_msg=f"window {update}",
            )
    assert scales[1] == 0.0 and scales[3] < scales[2]
    assert max(scales) > 1.5
    np.testing.assert_allclose(
        [
            _value(optimizer.window_scale),
            _value(optimizer.scale_invariant_step),
        ],
        [scales[-1], tau],
        rtol=1e-5,
    )
    assert np.isnan(_value(optimizer.adascale_gain))
    for a, b in zip(model.get_weights(), parent.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "rule, weighted, accum_iters",
    [
        (("linear", 5.0), True, 4),
        (("sqrt", 0), False, 3),
        (("linear", 0), False, 1),  # a window kept for the clock
    ],
)
def test_a_window_of_the_base_batch_equals_the_base_run(
    rule, weighted, accum_iters
):
    """`S = 1` (the window weighs one base batch: `micro * accum_iters`
    samples weighted, `accum_iters` micro-batches not): every factor is 1,
    warm-up or not, and the run equals the parent Adam with the base
    schedule on the same batches; the logger records `S` and `tau`."""
    micro = 6
    x, y = regression_data(0, 4 * micro * accum_iters)
    base_batch = micro * accum_iters if weighted else accum_iters
    model = small_model(0)
    optimizer = AdamAccumulate(
        learning_rate=_rule(rule, base_batch), accum_iters=accum_iters
    )
    model.compile(optimizer=optimizer, loss="mse")
    logger = AccumulationLogger(update_freq="batch")
    ours = fit_in_order(
        model,
        x,
        y,
        weigh=weighted,
        batch_size=micro,
        epochs=2,
        callbacks=[logger],
    )
    parent = small_model(0)
    parent.compile(
        optimizer=keras.optimizers.Adam(learning_rate=_base_schedule()),
        loss="mse",
    )
    fit_in_order(parent, x, y, batch_size=micro * accum_iters, epochs=2)
    updates = 2 * len(x) // (micro * accum_iters)
    assert _value(optimizer.window_scale) == 1.0
    assert _value(optimizer.scale_invariant_step) == updates
    assert logger.windows["window_scale"] == [1.0] * updates
    assert logger.windows["scale_invariant_step"] == list(range(1, updates + 1))
    for a, b in zip(ours.get_weights(), parent.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


RESUMES = {
    "keras_by_samples": ("keras", ("linear", 6.0), False),
    "weights_by_noise_scale": ("weights", ("sqrt", 0), True),
}


def _model(rule, by_noise_scale):
    model = small_model(3)
    accum_iters = schedules.by_samples({0: 2, 40: 3, 100: 5})
    measure = {}
    if by_noise_scale:
        accum_iters = schedules.by_noise_scale(4, floor=2, ceiling=6)
        measure = {"measure_noise_scale": True, "noise_scale_momentum": 0.8}
    model.compile(
        optimizer=AdamAccumulate(
            learning_rate=_rule(rule, 4), accum_iters=accum_iters, **measure
        ),
        loss="mse",
    )
    weigh_micro_batches(model)
    return model


@pytest.mark.parametrize("resume", list(RESUMES))
def test_a_run_saved_mid_window_resumes_exactly(resume, tmp_path):
    """`tau` and the last `S` are saved state: a run saved mid-window (a
    `.keras` file, or a weights file loaded into a new model) and resumed
    ends as the uninterrupted run, `tau` included, with windows keyed on
    samples or sized by the noise scale."""
    saved_as, rule, by_noise_scale = RESUMES[resume]
    x, y = regression_data(4, 200)
    split = 4 * 21  # 21 micro-batches: mid-window
    whole, first = fit_interrupted(
        lambda: _model(rule, by_noise_scale), x, y, split, 4
    )
    if saved_as == "keras":
        path = tmp_path / "model.keras"
        first.save(path)
        resumed = keras.models.load_model(path)
        weigh_micro_batches(resumed)
    else:
        path = tmp_path / "model.weights.h5"
        first.save_weights(path)
        resumed = _model(rule, by_noise_scale)
        resumed.optimizer.build(resumed.trainable_variables)
        resumed.load_weights(path)
    assert resumed.optimizer._learning_rate.get_config() == (
        whole.optimizer._learning_rate.get_config()
    )
    fit_in_order(resumed, x[split:], y[split:], batch_size=4)
    updates = int(to_numpy(whole.optimizer.iterations))
    assert _value(whole.optimizer.scale_invariant_step) > 1.5 * updates
    for what in ("scale_invariant_step", "window_scale", "learning_rate"):
        np.testing.assert_allclose(
            _value(getattr(resumed.optimizer, what)),
            _value(getattr(whole.optimizer, what)),
            rtol=1e-6,
        )
    for a, b in zip(resumed.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("accum_iters", [1, 2])
def test_a_state_saved_without_a_rule_continues_the_base_schedule(
    accum_iters,
):
    """The parent Adam's state loaded into an optimizer with a rule: each
    update it applied was one base step (`tau` 5, the last `S` 1), and the
    next update's rate is the base rate at 5 (`S = 1` here)."""
    variables = [keras.Variable(np.ones(s, "float32")) for s in (3, 2)]
    parent = keras.optimizers.Adam(learning_rate=_base_schedule())
    parent.build(variables)
    for _ in range(5):
        parent.apply([keras.ops.ones(v.shape) for v in variables], variables)
    store = {}
    parent.save_own_variables(store)
    optimizer = AdamAccumulate(
        learning_rate=_rule(("linear", 3.0), accum_iters),
        accum_iters=accum_iters,
    )
    optimizer.build(variables)
    optimizer.load_own_variables(store)
    assert _value(optimizer.scale_invariant_step) == 5.0
    assert _value(optimizer.window_scale) == 1.0
    assert _value(optimizer.learning_rate) == pytest.approx(_base_rate(5))


@pytest.mark.parametrize("rule", [("linear", 2.5), ("sqrt", 0)])
def test_its_config_round_trips(rule):
    optimizer = AdamAccumulate(
        learning_rate=_rule(
            rule, 16, keras.optimizers.schedules.CosineDecay(0.1, 100)
        ),
        accum_iters=4,
    )
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    learning_rate = again._learning_rate
    assert type(learning_rate) is type(optimizer._learning_rate)
    assert learning_rate.get_config() == optimizer._learning_rate.get_config()
    assert repr(learning_rate).startswith(f"{rule[0]}_scaling(<")
    assert learning_rate.base_batch_size == 16
    if rule[0] == "linear":
        assert learning_rate.warmup_steps == 2.5


_DECAY = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: schedules.linear_scaling(0.1, base_batch_size=0),
            ValueError,
            "base_batch_size=0",
        ),
        (
            lambda: schedules.sqrt_scaling(0.1, base_batch_size=float("inf")),
            ValueError,
            "base_batch_size=inf",
        ),
        (
            lambda: schedules.sqrt_scaling(0.1, base_batch_size="8"),
            ValueError,
            "base_batch_size='8'",
        ),
        (
            lambda: schedules.linear_scaling(0.1, 8, warmup_steps=-1),
            ValueError,
            "warmup_steps=-1",
        ),
        (
            lambda: schedules.linear_scaling(0.1, 8, warmup_steps=True),
            ValueError,
            "warmup_steps=True",
        ),
        (
            lambda: schedules.linear_scaling(-0.1, 8),
            ValueError,
            "learning_rate=-0.1",
        ),
        (
            lambda: schedules.sqrt_scaling(schedules.by_samples(_DECAY), 8),
            TypeError,
            "keyed on updates",
        ),
        (
            lambda: schedules.linear_scaling(schedules.sqrt_scaling(0.1, 8), 8),
            TypeError,
            "keyed on updates",
        ),
        (
            lambda: keras.optimizers.Adam(schedules.sqrt_scaling(0.1, 8)).apply(
                [keras.ops.ones((2,))], [keras.Variable(np.ones(2))]
            ),
            TypeError,
            "sqrt_scaling.*not of a plain Keras optimizer",
        ),
    ],
)
def test_what_it_refuses_is_named(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_multi_optimizer_of_several_refuses_it_by_name():
    """`tau` is the model's clock, where each optimizer of a
    `MultiOptimizer` keeps a window of its own: `fit` raises, naming
    both, before anything moves."""
    x, y = regression_data(1, 16)
    scaled = AdamAccumulate(
        learning_rate=schedules.linear_scaling(0.1, base_batch_size=4),
        accum_iters=2,
    )
    other = AdamAccumulate(0.1, accum_iters=2)
    model = small_model(1)
    before = model.get_weights()
    model.compile(
        optimizer=keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(scaled, {".*bias": other})
        ),
        loss="mse",
    )
    with pytest.raises(
        ValueError, match="MultiOptimizer '.*'adam_accumulate.*linear_scaling"
    ):
        model.fit(x, y, batch_size=4, verbose=0)
    if BACKEND != "jax":  # Keras' JAX trainer leaves no values after it
        for a, b in zip(model.get_weights(), before):
            np.testing.assert_array_equal(a, b)
