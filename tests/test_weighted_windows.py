"""Weighted windows: a window of uneven micro-batches equals its
concatenated big batch.

The oracle is the parent Keras optimizer on the big batch: in custom loops
the gradient of the big batch's mean loss (computed in numpy, for a linear
least-squares model); in `fit`, the parent fitted with
`batch_size = accum_iters * b` on the same data. The distributed cases are
in `test_weighted_distributed.py`.
"""

import pickle

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import assert_same_weights
from helpers import fit_in_order
from helpers import largest_difference
from helpers import parent_on_window_means
from helpers import to_numpy
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from modes import MODES
from modes import applier

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import weigh_micro_batches

BACKEND = keras.backend.backend()
IN, OUT = 3, 2


# -- Custom loops: a least-squares model, gradients in numpy -----------------


def _linear_problem(seed, sizes):
    rng = np.random.default_rng(seed)
    weights = [
        rng.normal(size=(IN, OUT)).astype("float32"),
        rng.normal(size=(OUT,)).astype("float32"),
    ]
    batches = [
        (
            rng.normal(size=(n, IN)).astype("float32"),
            rng.normal(size=(n, OUT)).astype("float32"),
        )
        for n in sizes
    ]
    return weights, batches


def _mean_loss_gradient(weights, x, y):
    """Gradient of mean((x @ w + b - y) ** 2) over the batch's values."""
    w, b = (np.asarray(v, "float64") for v in weights)
    residual = x @ w + b - y
    scale = 2.0 / residual.size
    return [
        (scale * x.T @ residual).astype("float32"),
        (scale * residual.sum(0)).astype("float32"),
    ]


def _optimizers(name):
    if name == "sgd":
        return (
            SGDAccumulate,
            keras.optimizers.SGD,
            dict(learning_rate=0.1, momentum=0.9),
        )
    return AdamAccumulate, keras.optimizers.Adam, dict(learning_rate=0.1)


def _run_windows(mode, name, sizes_per_window, seed, weigh=True):
    """Our optimizer on uneven micro-batches (weight = sample count), and
    the parent on each window's concatenated batch; returns both."""
    ours_class, parent_class, kwargs = _optimizers(name)
    k = len(sizes_per_window[0])
    initial, _ = _linear_problem(seed, [])
    ours = [keras.Variable(w) for w in initial]
    parent = [keras.Variable(w) for w in initial]
    optimizer = ours_class(accum_iters=k, **kwargs)
    step = applier(optimizer, ours, mode)
    parent_optimizer = parent_class(**kwargs)
    for window, sizes in enumerate(sizes_per_window):
        _, batches = _linear_problem(seed + 1 + window, sizes)
        at = to_numpy(ours)
        for x, y in batches:
            grads = _mean_loss_gradient(at, x, y)
            step(
                [keras.ops.convert_to_tensor(g) for g in grads],
                float(len(x)) if weigh else None,
            )
        x = np.concatenate([x for x, _ in batches])
        y = np.concatenate([y for _, y in batches])
        big = _mean_loss_gradient(to_numpy(parent), x, y)
        parent_optimizer.apply(
            [keras.ops.convert_to_tensor(g) for g in big], parent
        )
    return to_numpy(ours), to_numpy(parent)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sgd", "adam"])
@given(
    sizes=st.lists(
        st.lists(st.integers(1, 9), min_size=3, max_size=3),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 2**16),
)
def test_uneven_micro_batches_weighted_by_size_equal_the_big_batch(
    mode, name, sizes, seed
):
    ours, parent = _run_windows(mode, name, sizes, seed)
    assert_all_close(ours, parent, rtol=1e-5, atol=2e-6)


def test_unweighted_uneven_micro_batches_differ_from_the_big_batch():
    # The property above is not vacuous: unweighted, uneven windows differ.
    ours, parent = _run_windows("eager", "sgd", [[1, 8, 2]], 3, weigh=False)
    assert largest_difference(ours, parent) > 1e-3


def test_weight_none_counts_one_beside_weighted_calls():
    initial, batches = _linear_problem(5, [4, 4, 4])
    ours = [keras.Variable(w) for w in initial]
    parent = [keras.Variable(w) for w in initial]
    optimizer = SGDAccumulate(0.1, accum_iters=3)
    grads = [_mean_loss_gradient(initial, x, y) for x, y in batches]
    for g, weight in zip(grads, [None, 3.0, None]):
        optimizer.apply(
            [keras.ops.convert_to_tensor(v) for v in g], ours, weight=weight
        )
    parent_on_window_means(
        keras.optimizers.SGD(0.1), parent, [grads], [[None, 3.0, None]]
    )
    assert_all_close(ours, parent, rtol=1e-5, atol=2e-6)


def test_apply_gradients_takes_the_weight():
    initial, batches = _linear_problem(6, [2, 6])
    ours = [keras.Variable(w) for w in initial]
    parent = [keras.Variable(w) for w in initial]
    optimizer = AdamAccumulate(0.1, accum_iters=2)
    for x, y in batches:
        grads = _mean_loss_gradient(initial, x, y)
        grads = [keras.ops.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, ours), weight=len(x))
    x = np.concatenate([x for x, _ in batches])
    y = np.concatenate([y for _, y in batches])
    big = _mean_loss_gradient(initial, x, y)
    keras.optimizers.Adam(0.1).apply(
        [keras.ops.convert_to_tensor(g) for g in big], parent
    )
    assert_all_close(ours, parent, rtol=1e-5, atol=2e-6)


def test_accum_iters_one_accepts_and_checks_a_weight():
    initial, batches = _linear_problem(7, [3])
    ours = [keras.Variable(w) for w in initial]
    parent = [keras.Variable(w) for w in initial]
    grads = [
        keras.ops.convert_to_tensor(g)
        for g in _mean_loss_gradient(initial, *batches[0])
    ]
    AdamAccumulate(0.1).apply(grads, ours, weight=3)
    keras.optimizers.Adam(0.1).apply(grads, parent)
    assert_all_close(ours, parent, rtol=0, atol=0)
    with pytest.raises(ValueError, match="weight=-1"):
        AdamAccumulate(0.1).apply(grads, ours, weight=-1)


def test_a_weighted_pending_window_resumes_after_saving():
    initial, batches = _linear_problem(8, [1, 7, 3])
    grads = [_mean_loss_gradient(initial, x, y) for x, y in batches]
    weights = [1.0, 7.0, 3.0]

    def tensors(g):
        return [keras.ops.convert_to_tensor(v) for v in g]

    first = [keras.Variable(w) for w in initial]
    interrupted = AdamAccumulate(0.1, accum_iters=3)
    for g, n in zip(grads[:2], weights[:2]):
        interrupted.apply(tensors(g), first, weight=n)
    store = {}
    interrupted.save_own_variables(store)
    store = pickle.loads(pickle.dumps(store))  # as a file would hold it

    resumed_vars = [keras.Variable(w) for w in initial]
    resumed = AdamAccumulate(0.1, accum_iters=3)
    resumed.build(resumed_vars)
    resumed.load_own_variables(store)
    resumed.apply(tensors(grads[2]), resumed_vars, weight=weights[2])

    parent = [keras.Variable(w) for w in initial]
    parent_on_window_means(
        keras.optimizers.Adam(0.1), parent, [grads], [weights]
    )
    assert_all_close(resumed_vars, parent, rtol=1e-5, atol=2e-6)


# -- Bad weights ------------------------------------------------------------

BAD_WEIGHTS = [0, -2.0, float("nan"), float("inf"), 1e39, True, "3"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", BAD_WEIGHTS[:4])
def test_a_bad_weight_raises_and_changes_nothing(mode, bad):
    initial, batches = _linear_problem(9, [2, 2])
    variables = [keras.Variable(w) for w in initial]
    optimizer = AdamAccumulate(0.1, accum_iters=2)
    step = applier(optimizer, variables, mode)
    grads = [
        keras.ops.convert_to_tensor(g)
        for g in _mean_loss_gradient(initial, *batches[0])
    ]
    step(grads, 2.0)
    before = to_numpy(variables) + to_numpy(optimizer.variables)
    if mode in ("xla", "jit"):
        # Compiled XLA code cannot raise: the window closing here turns NaN.
        step(grads, bad)
        assert all(np.isnan(v).all() for v in to_numpy(variables))
        return
    with pytest.raises(Exception, match="weight"):
        step(grads, bad)
    assert_all_close(
        to_numpy(variables) + to_numpy(optimizer.variables),
        before,
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("bad", BAD_WEIGHTS[4:] + [np.ones(2)])
def test_a_weight_that_is_no_number_is_refused_naming_it(bad):
    variables = [keras.Variable(np.ones((2,), "float32"))]
    optimizer = SGDAccumulate(0.1, accum_iters=2)
    with pytest.raises(ValueError, match="weight="):
        optimizer.apply([keras.ops.ones((2,))], variables, weight=bad)
    assert int(optimizer.micro_steps) == 0


# -- fit ----------------------------------------------------------------------

K, B = 3, 4


def _dense_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((IN,)),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(OUT),
        ]
    )


def _sequence_model():
    keras.utils.set_random_seed(1)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(12, 4, mask_zero=True)(tokens)
    return keras.Model(tokens, keras.layers.Dense(3)(hidden))


def _dense_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IN)).astype("float32")
    y = rng.normal(size=(n, OUT)).astype("float32")
    sample_weight = rng.uniform(0.1, 2.0, size=n).astype("float32")
    return x, y, sample_weight


def _sequence_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 12, size=(n, 6))
    for row, length in zip(x, rng.integers(1, 7, size=n)):
        row[length:] = 0
    return x, rng.integers(0, 3, size=(n, 6))


def _fit_pair(
    make,
    loss,
    x,
    y,
    sample_weight=None,
    optimizer="sgd",
    epochs=2,
    weigh=True,
    **compile_kwargs,
):
    """(ours at B with accum_iters=K, parent at K * B): their weights."""
    ours_class, parent_class, kwargs = _optimizers(optimizer)
    parent = make()
    parent.compile(
        optimizer=parent_class(**kwargs), loss=loss, **compile_kwargs
    )
    fit_in_order(
        parent,
        x,
        y,
        sample_weight=sample_weight,
        batch_size=K * B,
        epochs=epochs,
    )
    ours = make()
    ours.compile(
        optimizer=ours_class(accum_iters=K, **kwargs),
        loss=loss,
        **compile_kwargs,
    )
    if weigh:
        weigh_micro_batches(ours)
    fit_in_order(
        ours,
        x,
        y,
        sample_weight=sample_weight,
        batch_size=B,
        epochs=epochs,
        flush=True,
    )
    return ours.get_weights(), parent.get_weights()


def _fit_rows(model, data, rows, **kwargs):
    """`fit_in_order` at micro-batches of `B` on the rows `rows` of
    `data`, `(x, y, sample_weight)`."""
    x, y, sample_weight = (array[rows] for array in data)
    fit_in_order(
        model, x, y, sample_weight=sample_weight, batch_size=B, **kwargs
    )


FIT_MODES = {
    "tensorflow": [dict(), dict(jit_compile=True), dict(run_eagerly=True)],
    "jax": [dict(), dict(run_eagerly=True)],
    "torch": [dict()],
}[BACKEND]


@pytest.mark.parametrize("compile_kwargs", FIT_MODES, ids=str)
def test_fit_with_a_short_last_micro_batch_equals_the_big_batch(
    compile_kwargs,
):
    x, y, _ = _dense_data(2 * K * B + 5)  # 5 samples: a short window
    ours, parent = _fit_pair(
        _dense_model, "mse", x, y, optimizer="adam", **compile_kwargs
    )
    assert_all_close(ours, parent, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "mean_with_sample_weight"]
)
def test_fit_with_sample_weights_equals_the_big_batch(reduction):
    x, y, sample_weight = _dense_data(2 * K * B + 7)
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    ours, parent = _fit_pair(
        _dense_model, loss, x, y, sample_weight, optimizer="adam"
    )
    assert_all_close(ours, parent, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("compile_kwargs", FIT_MODES, ids=str)
def test_fit_with_masked_sequences_equals_the_big_batch(compile_kwargs):
    # SGD: on TensorFlow, Keras' Adam treats an embedding's sparse gradient
    # with repeated rows differently from the dense gradient of the window.
    x, y = _sequence_data(2 * K * B + 3)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours, parent = _fit_pair(_sequence_model, loss, x, y, **compile_kwargs)
    assert_all_close(ours, parent, rtol=1e-5, atol=2e-6)


@settings(max_examples=min(4, settings.default.max_examples))
@given(
    samples=st.integers(K * B + 1, 3 * K * B),
    reduction=st.sampled_from(
        ["sum_over_batch_size", "mean_with_sample_weight"]
    ),
    weighted_samples=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fit_on_drawn_data_equals_the_big_batch(
    samples, reduction, weighted_samples, seed
):
    x, y, sample_weight = _dense_data(samples, seed)
    loss = keras.losses.MeanSquaredError(reduction=reduction)
    ours, parent = _fit_pair(
        _dense_model,
        loss,
        x,
        y,
        sample_weight if weighted_samples else None,
        optimizer="adam",
        epochs=1,
    )
    assert_all_close(ours, parent, rtol=1e-5, atol=2e-6)


def test_fit_unweighted_masked_sequences_differ_from_the_big_batch():
    # The tests above are not vacuous: without weighing, they differ.
    x, y = _sequence_data(2 * K * B + 3)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours, parent = _fit_pair(_sequence_model, loss, x, y, weigh=False)
    assert largest_difference(ours, parent) > 1e-4


def test_fit_through_a_loss_scale_optimizer_equals_the_big_batch():
    # The LossScaleOptimizer scales the loss itself: the weight is applied
    # to the gradients instead.
    x, y, sample_weight = _dense_data(2 * K * B + 5)
    parent = _dense_model()
    parent.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.1)
        ),
        loss="mse",
    )
    fit_in_order(
        parent, x, y, sample_weight=sample_weight, batch_size=K * B, epochs=2
    )
    ours = _dense_model()
    ours.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(
            AdamAccumulate(0.1, accum_iters=K)
        ),
        loss="mse",
    )
    weigh_micro_batches(ours)
    fit_in_order(
        ours,
        x,
        y,
        sample_weight=sample_weight,
        batch_size=B,
        epochs=2,
        flush=True,
    )
    assert_same_weights(ours, parent, rtol=1e-5, atol=2e-6)


def test_weighing_changes_nothing_for_equal_micro_batches():
    x, y, _ = _dense_data(2 * K * B)
    weighed, _ = _fit_pair(_dense_model, "mse", x, y, epochs=1)
    plain, _ = _fit_pair(_dense_model, "mse", x, y, epochs=1, weigh=False)
    assert_all_close(weighed, plain, rtol=1e-5, atol=1e-6)


def test_weigh_micro_batches_after_a_fit_retraces_the_train_step():
    # Micro-batches of 4, 4, 4 | 4, 2: the second window is uneven.
    n = K * B + B + 2
    data = x, y, sample_weight = _dense_data(n)
    # "sum_over_batch_size": the first window's equal micro-batches are
    # exact unweighted; the second's are not.
    loss = "mse"
    parent = _dense_model()
    parent.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    fit_in_order(parent, x, y, sample_weight=sample_weight, batch_size=K * B)
    ours = _dense_model()
    ours.compile(optimizer=SGDAccumulate(0.1, accum_iters=K), loss=loss)
    _fit_rows(ours, data, slice(0, K * B))  # traced unweighted
    weigh_micro_batches(ours)
    _fit_rows(ours, data, slice(K * B, n), flush=True)
    assert_same_weights(ours, parent, rtol=1e-5, atol=2e-6)


# -- What weigh_micro_batches refuses -----------------------------------------


def test_a_sum_reduction_is_refused_naming_it():
    x, y, _ = _dense_data(K * B)
    model = _dense_model()
    model.compile(
        optimizer=SGDAccumulate(0.1, accum_iters=K),
        loss=keras.losses.MeanSquaredError(reduction="sum"),
    )
    weigh_micro_batches(model)
    with pytest.raises(ValueError, match="reduction='sum'"):
        model.fit(x, y, batch_size=B, verbose=0)


def test_several_masked_losses_are_refused():
    x, y = _sequence_data(K * B)
    keras.utils.set_random_seed(1)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(12, 4, mask_zero=True)(tokens)
    model = keras.Model(
        tokens, [keras.layers.Dense(3)(hidden), keras.layers.Dense(3)(hidden)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=SGDAccumulate(0.1, accum_iters=K), loss=[loss, loss]
    )
    weigh_micro_batches(model)
    with pytest.raises(ValueError, match="losses"):
        model.fit(x, [y, y], batch_size=B, verbose=0)


def test_something_that_is_not_a_model_is_refused_naming_it():
    with pytest.raises(TypeError, match="model="):
        weigh_micro_batches(keras.layers.Dense(2))


def test_a_model_without_accumulation_trains_as_before():
    x, y, _ = _dense_data(K * B + 3)
    plain = _dense_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    fit_in_order(plain, x, y, batch_size=B)
    weighed = _dense_model()
    weighed.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    weigh_micro_batches(weighed)
    fit_in_order(weighed, x, y, batch_size=B)
    assert_same_weights(weighed, plain, rtol=0, atol=0)


def test_the_extra_weight_is_saved_in_keras_files(tmp_path):
    # A `.keras` file saved mid-window holds the pending window's weight.
    data = x, y, sample_weight = _dense_data(K * B)
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    parent = _dense_model()
    parent.compile(optimizer=keras.optimizers.Adam(0.1), loss=loss)
    fit_in_order(parent, x, y, sample_weight=sample_weight, batch_size=K * B)
    ours = _dense_model()
    ours.compile(optimizer=AdamAccumulate(0.1, accum_iters=K), loss=loss)
    weigh_micro_batches(ours)
    _fit_rows(ours, data, slice(0, B))
    path = tmp_path / "mid_window.keras"
    ours.save(path)
    resumed = keras.saving.load_model(path)
    weigh_micro_batches(resumed)
    _fit_rows(resumed, data, slice(B, None))
    assert int(resumed.optimizer.micro_steps) == 0
    assert_same_weights(resumed, parent, rtol=1e-5, atol=2e-6)
