"""The window's features: skipping non-finite micro-batches, the window's
own loss and gradient norm, and the samples seen (`by_samples` schedules).

Oracles: the parent Keras optimizer applying each window's mean gradient
computed in float64 numpy (custom loops), the parent fitted on the big
batch made of the remaining micro-batches (`fit`), the loss and gradient
norm of the big batch computed by the model itself, and the parent with
its learning rate set by hand at the sample counts of a run on growing big
batches.
"""

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import assert_same_weights
from helpers import fit_in_order
from helpers import parent_on_window_means
from helpers import regression_data
from helpers import sample_weights
from helpers import small_model
from helpers import to_numpy
from helpers import window_state
from modes import MODES
from modes import applier

from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import schedules
from accum_optimizers import weigh_micro_batches

BACKEND = keras.backend.backend()
SHAPES = ((3, 2), (2,))
# Round-off between a window's float32 sums and the float64 oracle.
RTOL, ATOL = 1e-5, 1e-6


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    return [
        keras.Variable(rng.normal(size=s).astype("float32")) for s in SHAPES
    ]


def _gradients(seed, count, bad=()):
    """`count` micro-steps of gradients; those in `bad` hold a NaN or an
    infinity in one entry of one variable."""
    rng = np.random.default_rng(seed)
    steps = []
    for n in range(count):
        step = [rng.normal(size=s).astype("float32") for s in SHAPES]
        if n in bad:
            step[n % 2].flat[0] = np.nan if n % 3 else np.inf
        steps.append(step)
    return steps


def _windows(steps, weights, k, bad):
    """The oracle's windows: the finite micro-steps, `k` at a time."""
    kept = [n for n in range(len(steps)) if n not in bad]
    full = len(kept) // k * k
    groups = [kept[i : i + k] for i in range(0, full, k)]
    return (
        [[steps[n] for n in group] for group in groups],
        [[weights[n] for n in group] for group in groups],
        kept[full:],
    )


# -- skip_nonfinite in custom loops --------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_a_nonfinite_micro_batch_is_left_out_of_its_window(mode, weighted):
    bad = (2, 5, 6)
    steps = _gradients(1, 11, bad)
    rng = np.random.default_rng(2)
    weights = [float(rng.integers(1, 9)) if weighted else 1.0 for _ in steps]
    ours = AdamAccumulate(learning_rate=0.1, accum_iters=3, skip_nonfinite=True)
    variables = _variables()
    step = applier(ours, variables, mode)
    for grads, weight in zip(steps, weights):
        step(grads, weight if weighted else None)

    windows, window_weights, pending = _windows(steps, weights, 3, bad)
    reference = _variables()
    parent_on_window_means(
        keras.optimizers.Adam(learning_rate=0.1),
        reference,
        windows,
        window_weights,
    )
    assert_all_close(variables, reference, rtol=RTOL, atol=ATOL)
    assert int(to_numpy(ours.iterations)) == len(windows)
    assert int(to_numpy(ours.skipped_micro_batches)) == len(bad)
    assert int(to_numpy(ours.micro_steps)) == len(pending)
    assert int(to_numpy(ours.micro_batches_seen)) == len(steps) - len(bad)


@pytest.mark.parametrize("mode", MODES)
def test_one_nonfinite_entry_anywhere_in_a_large_gradient_is_caught(mode):
    # Where it lies must not matter to the check's sums, tiled or
    # vectorised (XLA reduces 1024 entries in blocks), nor its sign.
    shapes = ((1024,), (33, 31))
    rng = np.random.default_rng(5)
    initial = [rng.normal(size=s).astype("float32") for s in shapes]
    variables = [keras.Variable(v) for v in initial]
    ours = SGDAccumulate(learning_rate=0.1, accum_iters=2, skip_nonfinite=True)
    step = applier(ours, variables, mode)
    finite = [
        [rng.normal(size=s).astype("float32") for s in shapes] for _ in range(2)
    ]
    bad = 0
    for value in (np.nan, np.inf, -np.inf):
        for which in range(2):
            for position in (0, 517, -1):
                grads = [g.copy() for g in finite[bad % 2]]
                grads[which].flat[position] = value
                step(grads)
                bad += 1
    step(finite[0])
    step(finite[1])
    reference = [keras.Variable(v) for v in initial]
    parent_on_window_means(
        keras.optimizers.SGD(learning_rate=0.1), reference, [finite]
    )
    assert int(to_numpy(ours.skipped_micro_batches)) == bad == 18
    assert int(to_numpy(ours.iterations)) == 1
    assert_all_close(variables, reference, rtol=RTOL, atol=ATOL)


def test_without_skip_nonfinite_a_nonfinite_micro_batch_poisons_the_window():
    ours = SGDAccumulate(learning_rate=0.1, accum_iters=2)
    variables = _variables()
    for grads in _gradients(1, 4, bad=(2,)):
        ours.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
    assert not np.isfinite(to_numpy(variables[0])).all()
    assert int(to_numpy(ours.skipped_micro_batches)) == 0


@pytest.mark.parametrize("mode", MODES)
def test_skipping_with_a_window_of_one_keeps_the_parent_on_finite_steps(mode):
    steps = _gradients(3, 5, bad=(1, 3))
    ours = AdamAccumulate(learning_rate=0.1, skip_nonfinite=True)
    variables = _variables()
    step = applier(ours, variables, mode)
    for grads in steps:
        step(grads)
    reference = _variables()
    parent_on_window_means(
        keras.optimizers.Adam(learning_rate=0.1),
        reference,
        [[steps[n]] for n in (0, 2, 4)],
    )
    assert_all_close(variables, reference, rtol=RTOL, atol=ATOL)
    assert int(to_numpy(ours.skipped_micro_batches)) == 2


def test_flush_after_a_skipped_micro_batch_averages_the_finite_ones():
    steps = _gradients(4, 3, bad=(1,))
    ours = AdamAccumulate(learning_rate=0.1, accum_iters=4, skip_nonfinite=True)
    variables = _variables()
    for grads in steps:
        ours.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
    ours.flush()
    reference = _variables()
    parent_on_window_means(
        keras.optimizers.Adam(learning_rate=0.1),
        reference,
        [[steps[0], steps[2]]],
        updated="any",
    )
    assert_all_close(variables, reference, rtol=RTOL, atol=ATOL)


def test_the_skip_count_and_flag_survive_saving(tmp_path):
    steps = _gradients(5, 4, bad=(1,))
    ours = AdamAccumulate(learning_rate=0.1, accum_iters=4, skip_nonfinite=True)
    variables = _variables()
    for grads in steps:
        ours.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
    config = ours.get_config()
    assert config["skip_nonfinite"] is True
    restored = AdamAccumulate.from_config(config)
    restored.build(_variables())
    store = {str(i): to_numpy(v) for i, v in enumerate(ours.variables)}
    restored.load_own_variables(store)
    assert restored.skip_nonfinite is True
    assert int(to_numpy(restored.skipped_micro_batches)) == 1
    assert int(to_numpy(restored.micro_steps)) == 3


def test_skip_nonfinite_must_be_a_bool():
    with pytest.raises(TypeError, match="skip_nonfinite=1"):
        AdamAccumulate(accum_iters=2, skip_nonfinite=1)


# -- skip_nonfinite in fit ---------------------------------------------------


def _fit_data(bad_batches, batch, count):
    x, y = regression_data(7, batch * count)
    for n in bad_batches:
        x[n * batch, 0] = np.nan  # its loss, and so its gradients, are NaN
    return x, y


def _parent_without(bad, x, y, batch, k, sample_weight=None):
    """The oracle: Adam fitted on the big batches of `k` micro-batches of
    `batch` made of those not in `bad`."""
    count = len(x) // batch
    kept = np.concatenate(
        [
            np.arange(n * batch, (n + 1) * batch)
            for n in range(count)
            if n not in bad
        ]
    )
    reference = small_model(0)
    reference.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.05), loss="mse"
    )
    fit_in_order(
        reference,
        x[kept],
        y[kept],
        sample_weight=None if sample_weight is None else sample_weight[kept],
        batch_size=k * batch,
    )
    return reference


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_skips_a_micro_batch_with_a_nan_loss(jit_compile):
    batch, bad = 4, (1, 6)
    x, y = _fit_data(bad, batch, 12)
    model = small_model(0)
    ours = AdamAccumulate(
        learning_rate=0.05, accum_iters=2, skip_nonfinite=True
    )
    model.compile(optimizer=ours, loss="mse", jit_compile=jit_compile)
    fit_in_order(model, x, y, batch_size=batch, epochs=1)
    assert_same_weights(model, _parent_without(bad, x, y, batch, 2))
    assert int(to_numpy(ours.skipped_micro_batches)) == 2
    assert int(to_numpy(ours.iterations)) == 5


def test_fit_skips_weighted_micro_batches_and_flushes_the_rest():
    batch, bad = 4, (2,)
    x, y = _fit_data(bad, batch, 7)
    weights = sample_weights(8, len(x))
    model = small_model(0)
    ours = AdamAccumulate(
        learning_rate=0.05, accum_iters=3, skip_nonfinite=True
    )
    model.compile(optimizer=ours, loss="mse")
    fit_in_order(
        model,
        x,
        y,
        sample_weight=weights,
        batch_size=batch,
        weigh=True,
        flush=True,
    )
    reference = _parent_without(bad, x, y, batch, 3, sample_weight=weights)
    assert_same_weights(model, reference)


def test_a_loss_scale_optimizer_skips_nonfinite_steps_before_the_window():
    # The LossScaleOptimizer drops a step whose gradients are not finite
    # (and lowers its scale) before calling the inner optimizer: such a
    # micro-batch never reaches the window, and is not counted as skipped.
    batch, bad = 4, (1,)
    x, y = _fit_data(bad, batch, 5)
    model = small_model(0)
    ours = AdamAccumulate(
        learning_rate=0.05, accum_iters=2, skip_nonfinite=True
    )
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(ours), loss="mse"
    )
    fit_in_order(model, x, y, batch_size=batch)
    assert_same_weights(model, _parent_without(bad, x, y, batch, 2))
    assert int(to_numpy(ours.skipped_micro_batches)) == 0
    assert int(to_numpy(ours.micro_batches_seen)) == 4


# -- The window's loss and gradient norm ------------------------------------


def _big_batch_loss_and_norm(model, x, y, weights=None):
    """The model's own loss and gradient norm on the big batch, with the
    weights as they are."""
    loss_fn = keras.losses.MeanSquaredError()
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x), sample_weight=weights)
        grads = tape.gradient(loss, model.trainable_variables)
    elif BACKEND == "jax":
        import jax

        def compute(trainable):
            y_pred, _ = model.stateless_call(
                trainable, [v.value for v in model.non_trainable_variables], x
            )
            return loss_fn(y, y_pred, sample_weight=weights)

        loss, grads = jax.value_and_grad(compute)(
            [v.value for v in model.trainable_variables]
        )
    else:
        import torch

        model.zero_grad()
        loss = loss_fn(
            torch.as_tensor(y),
            model(torch.as_tensor(x)),
            sample_weight=None if weights is None else torch.as_tensor(weights),
        )
        loss.backward()
        grads = [v.value.grad for v in model.trainable_variables]
    grads = to_numpy(list(grads))
    norm = np.sqrt(sum(float(np.sum(g.astype("float64") ** 2)) for g in grads))
    return float(to_numpy(loss)), norm


@pytest.mark.parametrize("weighted", [False, True])
def test_fit_reports_the_big_batch_loss_and_gradient_norm(weighted):
    batch, k = 4, 3
    x, y = regression_data(11, batch * k * 2)
    weights = sample_weights(12, len(x)) if weighted else None
    model = small_model(0)
    ours = AdamAccumulate(learning_rate=0.05, accum_iters=k)
    model.compile(optimizer=ours, loss="mse")
    if weighted:
        weigh_micro_batches(model)
    # The first window, then the second from the weights the first left.
    window = batch * k
    reference = small_model(0)
    expected = []
    for start in (0, window):
        reference.set_weights(model.get_weights())
        part = slice(start, start + window)
        expected.append(
            _big_batch_loss_and_norm(
                reference,
                x[part],
                y[part],
                None if weights is None else weights[part],
            )
        )
        fit_in_order(
            model,
            x[part],
            y[part],
            sample_weight=None if weights is None else weights[part],
            batch_size=batch,
        )
        loss, norm = expected[-1]
        np.testing.assert_allclose(to_numpy(ours.window_loss), loss, 1e-5)
        np.testing.assert_allclose(to_numpy(ours.window_grad_norm), norm, 1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_a_custom_loop_reports_the_weighted_mean_of_its_losses(mode):
    steps = _gradients(13, 6)
    losses = [0.5, 2.0, 1.25, 3.0, 0.75, 1.5]
    weights = [2.0, 1.0, 5.0, 3.0, 1.0, 4.0]
    ours = SGDAccumulate(learning_rate=0.1, accum_iters=3)
    variables = _variables()
    step = applier(ours, variables, mode)
    for grads, loss, weight in zip(steps[:3], losses, weights):
        step(grads, weight, loss)
    expected = np.average(losses[:3], weights=weights[:3])
    np.testing.assert_allclose(to_numpy(ours.window_loss), expected, 1e-6)
    mean = [
        np.average(
            np.asarray([s[i] for s in steps[:3]], "float64"), 0, weights[:3]
        )
        for i in range(len(SHAPES))
    ]
    norm = np.sqrt(sum(np.sum(m**2) for m in mean))
    np.testing.assert_allclose(to_numpy(ours.window_grad_norm), norm, 1e-5)
    # A micro-batch without its loss: the window reports none.
    for grads in steps[3:]:
        step(grads)
    assert np.isnan(to_numpy(ours.window_loss))


def test_the_logger_shows_the_window_metrics_once_per_update():
    batch, k = 4, 2
    x, y = _fit_data((3,), batch, 9)
    model = small_model(0)
    ours = AdamAccumulate(
        learning_rate=0.05, accum_iters=k, skip_nonfinite=True
    )
    model.compile(optimizer=ours, loss="mse")
    logger = AccumulationLogger(update_freq="batch")
    history = model.fit(
        x,
        y,
        batch_size=batch,
        shuffle=False,
        verbose=0,
        callbacks=[logger, FlushAccumulation()],
    )
    updates = logger.windows["updates"]
    assert updates == [1, 2, 3, 4]
    assert logger.windows["skipped_micro_batches"] == [0, 1, 1, 1]
    assert logger.windows["samples_seen"] == [2.0, 4.0, 6.0, 8.0]
    for name in ("window_loss", "window_grad_norm"):
        assert len(logger.windows[name]) == 4
        assert np.isfinite(logger.windows[name]).all()
    # `History` holds the epoch's values: those of its last window (the
    # 4th: 8 finite micro-batches, the last applied by the epoch's end).
    np.testing.assert_allclose(
        history.history["window_loss"][-1], logger.windows["window_loss"][-1]
    )
    assert history.history["skipped_micro_batches"] == [1]


# -- Samples seen --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_samples_seen_counts_applied_weight_past_float32s_integers(mode):
    ours = SGDAccumulate(learning_rate=0.0, accum_iters=2)
    variables = _variables()
    step = applier(ours, variables, mode)
    weight = 4097.0
    for grads in _gradients(15, 2 * 6):
        step(grads, weight)
    assert float(to_numpy(ours.samples_seen)) == 6 * 2 * weight
    # Past 2**24 a float32 total drops odd counts; the pair keeps them.
    window_state(ours)["samples_seen"].assign(2.0**24)
    for grads in _gradients(16, 2 * 3):
        step(grads, 1.5)
    hi = float(to_numpy(window_state(ours)["samples_seen"]))
    lo = float(to_numpy(window_state(ours)["samples_seen_error"]))
    assert hi + lo == 2.0**24 + 3 * 3.0


def test_by_samples_rejects_what_it_cannot_key():
    with pytest.raises(TypeError, match="schedule=3"):
        schedules.by_samples(3)
    lr = schedules.by_samples(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    )
    plain = keras.optimizers.SGD(learning_rate=lr)
    with pytest.raises(TypeError, match="accumulating optimizer"):
        plain.build(_variables())
        plain.apply(
            [keras.ops.convert_to_tensor(g) for g in _gradients(0, 1)[0]],
            plain._trainable_variables,
        )


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_ramp_keeps_a_learning_rate_defined_per_sample(mode):
    """Windows of 1, then 2, then 4 micro-batches of 8 samples, switching at
    sample counts; the learning rate decays per sample. The oracle is the
    parent fed the same growing big batches, with its learning rate set at
    the samples seen before each."""
    decay = keras.optimizers.schedules.ExponentialDecay(
        0.1, decay_steps=40, decay_rate=0.5
    )
    ours = AdamAccumulate(
        learning_rate=schedules.by_samples(decay),
        accum_iters=schedules.by_samples({0: 1, 16: 2, 48: 4}),
    )
    variables = _variables()
    step = applier(ours, variables, mode)
    steps = _gradients(17, 14)
    for grads in steps:
        step(grads, 8.0)
    # Windows: 1, 1 (16 samples), 2, 2 (48), 4, 4.
    sizes = [1, 1, 2, 2, 4, 4]
    reference = _variables()
    parent = keras.optimizers.Adam(learning_rate=0.1)
    parent.build(reference)
    start, samples = 0, 0.0
    for size in sizes:
        parent.learning_rate.assign(float(to_numpy(decay(samples))))
        parent_on_window_means(parent, reference, [steps[start : start + size]])
        start += size
        samples += 8.0 * size
    assert_all_close(variables, reference, rtol=RTOL, atol=ATOL)
    assert float(to_numpy(ours.samples_seen)) == samples
    assert int(to_numpy(ours.iterations)) == len(sizes)


def test_fit_with_a_per_sample_warm_up_equals_the_parent_on_growing_batches():
    batch = 4
    x, y = regression_data(19, batch * 10)
    warm_up = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=100, warmup_target=0.1, warmup_steps=24
    )
    model = small_model(0)
    ours = AdamAccumulate(
        learning_rate=schedules.by_samples(warm_up),
        accum_iters=schedules.by_samples({0: 1, 8: 2, 24: 3}),
    )
    model.compile(optimizer=ours, loss="mse")
    weigh_micro_batches(model)  # samples, not micro-batches
    fit_in_order(model, x, y, batch_size=batch)
    # Batches of 4, 4 (8 samples), 8, 8 (24), 12: 36 samples, 4 pending.
    reference = small_model(0)
    parent = keras.optimizers.Adam(learning_rate=0.1)
    reference.compile(optimizer=parent, loss="mse")
    start = 0
    for size in (4, 4, 8, 8, 12):
        parent.learning_rate = float(to_numpy(warm_up(float(start))))
        reference.train_on_batch(
            x[start : start + size], y[start : start + size]
        )
        start += size
    assert_same_weights(model, reference)
    assert float(to_numpy(ours.samples_seen)) == 36.0


def test_by_samples_schedules_round_trip_through_config():
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    ours = AdamAccumulate(
        learning_rate=schedules.by_samples(decay),
        accum_iters=schedules.by_samples(schedules.LinearRamp(1, 4, 1000)),
    )
    restored = AdamAccumulate.from_config(
        keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(ours)
        ).get_config()
    )
    assert repr(restored.accum_iters) == repr(ours.accum_iters)
    assert isinstance(
        restored._learning_rate, schedules.SamplesLearningRateSchedule
    )


# -- Under a MultiOptimizer ----------------------------------------------------


# `keras.optimizers.MultiOptimizer` arrived after Keras 3.13.
needs_multi_optimizer = pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="this Keras has no MultiOptimizer",
)


def _multi(default, other):
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(default, {".*bias": other})
    )


@needs_multi_optimizer
def test_a_multi_optimizer_skips_a_micro_batch_in_every_inner_window():
    # Only the bias's gradient is NaN: the kernel's optimizer must skip the
    # micro-batch too, or the two windows drift apart.
    kernel = keras.Variable(np.ones((3, 2), "float32"), name="kernel")
    bias = keras.Variable(np.zeros((2,), "float32"), name="bias")
    inner = [
        SGDAccumulate(0.1, momentum=0.9, accum_iters=2, skip_nonfinite=True),
        AdamAccumulate(0.05, accum_iters=2, skip_nonfinite=True),
    ]
    multi = _multi(*inner)
    steps = _gradients(21, 5)
    steps[1][1][0] = np.nan
    for grads in steps:
        multi.apply(
            [keras.ops.convert_to_tensor(g) for g in grads], [kernel, bias]
        )
    for optimizer in inner:
        assert int(to_numpy(optimizer.skipped_micro_batches)) == 1
        assert int(to_numpy(optimizer.iterations)) == 2
    reference = [
        keras.Variable(np.ones((3, 2), "float32"), name="kernel"),
        keras.Variable(np.zeros((2,), "float32"), name="bias"),
    ]
    windows = [[steps[0], steps[2]], [steps[3], steps[4]]]
    parent_on_window_means(
        keras.optimizers.SGD(0.1, momentum=0.9),
        reference,
        [[[s[0], None] for s in w] for w in windows],
        updated=[0],
    )
    parent_on_window_means(
        keras.optimizers.Adam(0.05),
        reference,
        [[[None, s[1]] for s in w] for w in windows],
        updated=[1],
    )
    assert_all_close([kernel, bias], reference, rtol=RTOL, atol=ATOL)


@needs_multi_optimizer
def test_a_multi_optimizer_hands_fit_s_loss_to_every_inner_optimizer():
    batch, k = 4, 2
    x, y = regression_data(23, batch * k)
    model = small_model(0)
    inner = [
        SGDAccumulate(0.1, accum_iters=k),
        AdamAccumulate(0.05, accum_iters=k),
    ]
    model.compile(optimizer=_multi(*inner), loss="mse")
    reference = small_model(0)
    loss, norm = _big_batch_loss_and_norm(reference, x, y)
    fit_in_order(model, x, y, batch_size=batch)
    for optimizer in inner:
        np.testing.assert_allclose(to_numpy(optimizer.window_loss), loss, 1e-5)
    # Each inner optimizer's norm covers its own variables; together, the
    # big batch's.
    together = np.hypot(*[float(to_numpy(o.window_grad_norm)) for o in inner])
    np.testing.assert_allclose(together, norm, 1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_finite_gradients_whose_sum_overflows_are_kept(mode):
    # A plain sum of 2e38 + 2e38 overflows float32: the check, a sum of
    # each gradient, must not take it for an infinity.
    ours = SGDAccumulate(learning_rate=0.1, accum_iters=3, skip_nonfinite=True)
    variables = _variables()
    step = applier(ours, variables, mode)
    huge = [np.full(s, 2e38, "float32") for s in SHAPES]
    step(huge)
    step(_gradients(25, 1, bad=(0,))[0])
    assert int(to_numpy(ours.skipped_micro_batches)) == 1
    assert int(to_numpy(ours.micro_steps)) == 1


def test_a_keras_file_resumes_skips_samples_and_a_per_sample_schedule(
    tmp_path,
):
    # Oracle: the same run uninterrupted. Saved mid-window, after a skip.
    batch = 4
    x, y = _fit_data((1,), batch, 10)

    def optimizer():
        return AdamAccumulate(
            learning_rate=schedules.by_samples(
                keras.optimizers.schedules.ExponentialDecay(0.05, 8, 0.5)
            ),
            accum_iters=schedules.by_samples({0: 2, 6: 3}),
            skip_nonfinite=True,
        )

    whole = small_model(0)
    whole.compile(optimizer=optimizer(), loss="mse")
    fit_in_order(whole, x, y, batch_size=batch)

    first = small_model(0)
    first.compile(optimizer=optimizer(), loss="mse")
    fit_in_order(first, x[:24], y[:24], batch_size=batch)
    assert int(to_numpy(first.optimizer.micro_steps)) > 0
    path = tmp_path / "model.keras"
    first.save(path)
    resumed = keras.models.load_model(path)
    assert resumed.optimizer.skip_nonfinite is True
    fit_in_order(resumed, x[24:], y[24:], batch_size=batch)
    assert_same_weights(resumed, whole, rtol=1e-6, atol=1e-7)
    for name in ("skipped_micro_batches", "samples_seen", "iterations"):
        assert float(to_numpy(getattr(resumed.optimizer, name))) == float(
            to_numpy(getattr(whole.optimizer, name))
        )


@pytest.mark.parametrize("mode", MODES)
def test_skipping_under_an_accumulation_schedule(mode):
    # Windows of 1, 1, then 3 finite micro-batches.
    bad = (1, 4)
    steps = _gradients(27, 9, bad)
    ours = AdamAccumulate(
        learning_rate=0.1, accum_iters={0: 1, 2: 3}, skip_nonfinite=True
    )
    variables = _variables()
    step = applier(ours, variables, mode)
    for grads in steps:
        step(grads)
    finite = [steps[n] for n in range(len(steps)) if n not in bad]
    reference = _variables()
    parent_on_window_means(
        keras.optimizers.Adam(learning_rate=0.1),
        reference,
        [finite[:1], finite[1:2], finite[2:5]],
    )
    assert_all_close(variables, reference, rtol=RTOL, atol=ATOL)
    assert int(to_numpy(ours.micro_steps)) == 2


def test_skip_nonfinite_with_accum_batch_norm_is_refused_before_training():
    from accum_optimizers import AccumBatchNormalization

    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            AccumBatchNormalization(accum_iters=2, name="pooled"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=AdamAccumulate(accum_iters=2, skip_nonfinite=True),
        loss="mse",
    )
    x, y = regression_data(29, 8)
    before = to_numpy(model.weights)
    for callback in (FlushAccumulation(), AccumulationLogger()):
        with pytest.raises(ValueError, match="'pooled'"):
            model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])
    for a, b in zip(to_numpy(model.weights), before):
        np.testing.assert_array_equal(a, b)


def test_apply_gradients_takes_the_loss_too():
    ours = SGDAccumulate(learning_rate=0.1, accum_iters=2)
    variables = _variables()
    for grads, loss in zip(_gradients(31, 2), (1.0, 3.0)):
        ours.apply_gradients(
            zip([keras.ops.convert_to_tensor(g) for g in grads], variables),
            loss=loss,
        )
    np.testing.assert_allclose(to_numpy(ours.window_loss), 2.0)
