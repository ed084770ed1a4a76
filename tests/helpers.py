"""What the tests share: models, data, variables, drawn optimizer
configurations, `fit` in the data's order (`fit_in_order`), the comparisons
(`to_numpy`, `assert_all_close`, `assert_same_weights`, `assert_same_state`,
`largest_difference`) and the window-mean oracle (`parent_on_window_means`),
and the worker processes' launchers (`run_worker`, `run_mirrored_worker`,
`run_jax_worker`, `start_logged`). Use these rather than local copies."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
from hypothesis import strategies as st

from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate
from accum_optimizers import weigh_micro_batches

PARENTS = {
    AdamAccumulate: keras.optimizers.Adam,
    SGDAccumulate: keras.optimizers.SGD,
    RMSpropAccumulate: keras.optimizers.RMSprop,
}
TESTS = Path(__file__).resolve().parent


def small_model(
    seed, in_dim=4, hidden=6, out_dim=2, activation="tanh", head_name=None
):
    """A small dense model with weights fixed by `seed` (`head_name`: its
    last layer's name, for a path that does not depend on the models made
    before)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((in_dim,)),
            keras.layers.Dense(hidden, activation=activation),
            keras.layers.Dense(out_dim, name=head_name),
        ]
    )


def small_embedding_model(
    seed, vocabulary=7, tokens=3, dim=3, out_dim=2, head_name=None
):
    """A small model whose first layer is an `Embedding` (its gradient an
    `IndexedSlices` on TensorFlow), weights fixed by `seed`: the tokens'
    vectors averaged, then a dense layer (named `head_name`)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((tokens,), dtype="int32"),
            keras.layers.Embedding(vocabulary, dim),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(out_dim, name=head_name),
        ]
    )


def regression_data(seed, n, in_dim=4, out_dim=2):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype("float32")
    y = rng.normal(size=(n, out_dim)).astype("float32")
    return x, y


def sample_weights(seed, n):
    """Sample weights, some 0, so that their sum differs from the count."""
    rng = np.random.default_rng(seed)
    return rng.choice([0.0, 0.5, 1.0, 3.0], size=n).astype("float32")


def random_variables(seed, shapes):
    """A `keras.Variable` of standard normal float32 values per shape."""
    rng = np.random.default_rng(seed)
    return [
        keras.Variable(rng.normal(size=s).astype("float32")) for s in shapes
    ]


def fit_in_order(model, x, y, *, weigh=False, flush=False, **kwargs):
    """`model.fit` on the samples in their order (`shuffle=False`), quietly,
    as the oracles the tests compare it with see them. With `weigh`,
    `weigh_micro_batches(model)` first; with `flush`, a
    `FlushAccumulation()` callback after the others (`kwargs`' `callbacks`)
    applies a window left pending at each epoch's end. Returns `model`."""
    if weigh:
        weigh_micro_batches(model)
    if flush:
        kwargs["callbacks"] = [
            *kwargs.get("callbacks", ()),
            FlushAccumulation(),
        ]
    model.fit(x, y, shuffle=False, verbose=0, **kwargs)
    return model


def fit_interrupted(make, x, y, split, batch_size, callbacks=()):
    """The two runs a resume is judged by: `make()`'s compiled model fitted
    on all of `x, y` (the uninterrupted run) and another fitted on the
    first `split` samples, with `callbacks` (the run interrupted there),
    both at `batch_size` in the data's order. Returns
    `(uninterrupted, interrupted)`; a resumed run goes on with
    `x[split:], y[split:]`."""
    uninterrupted = fit_in_order(make(), x, y, batch_size=batch_size)
    interrupted = fit_in_order(
        make(),
        x[:split],
        y[:split],
        batch_size=batch_size,
        callbacks=list(callbacks),
    )
    return uninterrupted, interrupted


def sequence_model(seed, vocab=12, length=6, classes=3):
    """Embedding(mask_zero=True) and a Dense layer, which keeps the mask:
    per-token logits whose loss counts only the tokens before padding."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocab, 4, mask_zero=True),
            keras.layers.Dense(classes),
        ]
    )


def sequence_data(seed, n, vocab=12, length=6, classes=3):
    """Token ids padded with 0 after a length drawn in [1, length], and a
    class per token."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(n, length))
    lengths = rng.integers(1, length + 1, size=n)
    tokens[np.arange(length) >= lengths[:, None]] = 0
    labels = rng.integers(0, classes, size=(n, length))
    return tokens.astype("int32"), labels.astype("int32")


def train_with_strategy(strategy, model, optimizer, distributed_batches, batch):
    """A custom tf.distribute loop: `strategy.run` inside a `tf.function`.

    Each replica's loss is its share of the mean squared error over the
    global micro-batch of `batch` samples, as Keras' `fit` computes it.
    """
    import tensorflow as tf

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_sample = tf.reduce_mean(tf.square(model(xb) - yb), axis=-1)
            loss = tf.nn.compute_average_loss(
                per_sample, global_batch_size=batch
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    for xb, yb in distributed_batches:
        step(xb, yb)


@st.composite
def optimizer_configs(draw):
    """Draws `(accumulating class, keyword arguments)` over every flag."""
    cls = draw(st.sampled_from(list(PARENTS)))
    if cls is AdamAccumulate:
        kwargs = {
            "learning_rate": draw(st.sampled_from([1e-3, 1e-2])),
            "beta_1": draw(st.sampled_from([0.8, 0.9])),
            "beta_2": draw(st.sampled_from([0.99, 0.999])),
            "amsgrad": draw(st.booleans()),
        }
    elif cls is SGDAccumulate:
        kwargs = {
            "learning_rate": draw(st.sampled_from([1e-2, 1e-1])),
            "momentum": draw(st.sampled_from([0.0, 0.5, 0.9])),
            "nesterov": draw(st.booleans()),
        }
    else:
        kwargs = {
            "learning_rate": draw(st.sampled_from([1e-3, 1e-2])),
            "rho": draw(st.sampled_from([0.8, 0.9])),
            "momentum": draw(st.sampled_from([0.0, 0.5])),
            "centered": draw(st.booleans()),
        }
    kwargs["learning_rate"] = draw(schedules(kwargs["learning_rate"]))
    kwargs["weight_decay"] = draw(st.sampled_from([None, 0.01, 0.1]))
    clip = draw(
        st.sampled_from([None, "clipnorm", "clipvalue", "global_clipnorm"])
    )
    if clip is not None:
        kwargs[clip] = draw(st.sampled_from([0.05, 0.5]))
    if draw(st.booleans()):
        kwargs["use_ema"] = True
        kwargs["ema_momentum"] = draw(st.sampled_from([0.5, 0.9]))
        kwargs["ema_overwrite_frequency"] = draw(st.sampled_from([None, 1, 2]))
    return cls, kwargs


def schedules(learning_rate):
    """A float learning rate, or a schedule that changes every few updates."""
    s = keras.optimizers.schedules
    return st.sampled_from(
        [
            learning_rate,
            s.ExponentialDecay(learning_rate, decay_steps=1, decay_rate=0.5),
            s.PiecewiseConstantDecay(
                [1, 2], [learning_rate, learning_rate / 2, learning_rate / 8]
            ),
            s.CosineDecay(
                0.0,
                decay_steps=3,
                warmup_target=learning_rate,
                warmup_steps=2,
            ),
            s.InverseTimeDecay(learning_rate, decay_steps=1, decay_rate=1.0),
        ]
    )


def to_numpy(values):
    """Numpy copies of Keras variables, backend tensors or arrays.

    Args:
        values: a list (or tuple) of them, or a single one.

    Returns:
        A list of `np.ndarray` for a list, one `np.ndarray` for a single
        value.
    """
    if isinstance(values, (list, tuple)):
        return [to_numpy(v) for v in values]
    return np.array(
        keras.ops.convert_to_numpy(getattr(values, "value", values))
    )


def largest_difference(actual, expected):
    """The largest absolute elementwise difference between two equally long
    lists of arrays (variables, tensors, `get_weights()`)."""
    actual, expected = to_numpy(list(actual)), to_numpy(list(expected))
    assert len(actual) == len(expected), (len(actual), len(expected))
    return max(float(np.max(np.abs(a - e))) for a, e in zip(actual, expected))


def assert_all_close(actual, expected, *, rtol, atol, what="value"):
    """Pairwise `np.testing.assert_allclose`, after checking that nothing
    is missing on either side.

    Args:
        actual: a list of variables, tensors or arrays, or a dict of them.
        expected: the same, as long (a dict: with the same keys).
        rtol: relative tolerance; the caller states it (and why).
        atol: absolute tolerance.
        what: what the items are, for the failure message (`"weight"`,
            `"optimizer variable"`).
    """
    if isinstance(expected, dict):
        assert set(actual) == set(expected), (sorted(actual), sorted(expected))
        labels = list(expected)
        actual = [actual[k] for k in labels]
        expected = [expected[k] for k in labels]
    else:
        actual, expected = list(actual), list(expected)
        assert len(actual) == len(expected), (
            f"{len(actual)} {what}s, expected {len(expected)}"
        )
        labels = [
            getattr(e, "path", None) or getattr(a, "path", None) or i
            for i, (a, e) in enumerate(zip(actual, expected))
        ]
    for label, a, e in zip(labels, to_numpy(actual), to_numpy(expected)):
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=atol, err_msg=f"{what} {label} differs"
        )


def parent_on_window_means(
    parent, variables, windows, weights=None, updated="any"
):
    """The oracle of custom loops: `parent`, a plain Keras optimizer on its
    own copy of the variables, applies each window's (weighted) mean
    gradient once, as it would the big batch's gradient.

    Args:
        parent: the parent Keras optimizer (built or not).
        variables: its variables, with the same initial values as ours.
        windows: a list of windows; a window is a list of micro-steps, a
            micro-step a list with one gradient (a numpy array) or `None`
            per variable. A `None` counts as zero in the window's mean.
        weights: for each window, the micro-steps' weights (`None` counts
            1); `None`: every micro-step weighs 1.
        updated: which variables a window updates. `"any"`: those with a
            gradient in any micro-step, as the big batch updates every
            variable any of its samples reached; or a list of variable
            indices (a `flush()` after a variable was frozen).
    """
    for n, window in enumerate(windows):
        window_weights = [1.0] * len(window) if weights is None else weights[n]
        window_weights = [1.0 if w is None else w for w in window_weights]
        assert len(window_weights) == len(window), (window_weights, window)
        if updated == "any":
            indices = [
                i
                for i in range(len(variables))
                if any(step[i] is not None for step in window)
            ]
        else:
            indices = list(updated)
        means = []
        for i in indices:
            zero = np.zeros(tuple(variables[i].shape), "float64")
            grads = [zero if s[i] is None else s[i] for s in window]
            mean = np.average(np.asarray(grads, "float64"), 0, window_weights)
            means.append(keras.ops.convert_to_tensor(mean.astype("float32")))
        if indices:
            parent.apply(means, [variables[i] for i in indices])


def assert_same_weights(model, reference, *, rtol=1e-4, atol=1e-6):
    """Two models' weights agree: by default to the float32 round-off
    between a window and its big batch (see `assert_same_state`); a resumed
    run against an uninterrupted one passes tighter tolerances."""
    assert_all_close(
        model.get_weights(),
        reference.get_weights(),
        rtol=rtol,
        atol=atol,
        what="weight",
    )


def assert_same_state(ours, parent_model, our_model, parent_optimizer):
    """Weights and every parent optimizer variable agree to f32 round-off.

    The two runs add the same float32 numbers in a different order (the
    big-batch gradient sums all samples at once; ours sums per micro-batch,
    then across micro-batches), so gradients differ by a few ulps. Adam and
    RMSprop divide by the root of the second moment, which turns a few ulps
    of a small gradient component into up to ~1e-4 relative in that
    component's update (5e-5 is the worst seen in 200-example runs).
    `rtol=1e-4, atol=1e-6` allows that and nothing more: a real difference
    in the update rule (a missed or extra update, a wrong learning rate, EMA
    step or clip) moves weights and moments by at least lr * |g| >~ 1e-4
    absolute and by far more than 1e-4 relative.
    """
    assert_same_weights(our_model, parent_model)
    parent_state = parent_optimizer.variables
    assert_all_close(
        ours.variables[: len(parent_state)],
        parent_state,
        rtol=1e-4,
        atol=1e-6,
        what="optimizer variable",
    )


def run_worker(args, env, *, cwd=TESTS, timeout=600):
    """Runs `python *args` in a fresh process in `cwd` with the environment
    `env`; asserts that it exited with 0 (showing its stderr's tail if not)
    and returns the completed process, its output captured as text."""
    completed = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def start_logged(args, env, log):
    """Starts `python *args` in `tests/` with the environment `env`, its
    stdout and stderr to the file `log` (a file, not a pipe: no process can
    block on a full pipe while the test waits on another); returns it."""
    with open(log, "w") as log_file:
        return subprocess.Popen(
            [sys.executable, *map(str, args)],
            cwd=TESTS,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


def run_mirrored_worker(script, out_path, timeout=600):
    """Runs `tests/<script>`, a `MirroredStrategy` worker over the 2 logical
    CPU devices of `mirrored_devices` (split before TensorFlow starts), in
    a fresh TensorFlow process, passing it `out_path`; checks that it ran
    over 2 replicas and returns the JSON it wrote there."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    run_worker([TESTS / script, out_path], env, timeout=timeout)
    results = json.loads(Path(out_path).read_text())
    assert results["replicas"] == 2, results["replicas"]
    return results


def jax_worker_env(device_count):
    """The environment of a JAX worker process: the JAX backend on the CPU
    with `device_count` host devices (XLA fixes the count at start-up) and
    this checkout's package first on the path."""
    xla_flags = os.environ.get("XLA_FLAGS", "")
    return dict(
        os.environ,
        KERAS_BACKEND="jax",
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{xla_flags} --xla_force_host_platform_device_count="
        f"{device_count}".strip(),
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join(
            [str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
        ),
    )


def run_jax_worker(script, out_path, device_count, timeout=300):
    """Runs `tests/<script>` in a fresh JAX process with `device_count` host
    CPU devices (XLA fixes the device count at start-up) and this
    checkout's package, passing it `out_path`; returns the JSON it wrote
    there.

    Args:
        script: the worker's file name, in `tests/`.
        out_path: where the worker writes its JSON result.
        device_count: the number of host devices it gets.
        timeout: seconds before the worker is killed.
    """
    run_worker(
        [TESTS / script, out_path],
        jax_worker_env(device_count),
        timeout=timeout,
    )
    return json.loads(Path(out_path).read_text())


def window_state(optimizer):
    """The window's variables of a built accumulating optimizer, by name as
    the window declares them, and `"sums"`, the per-variable sums: the one
    place the tests read the window's internals."""
    from accum_optimizers._window import spec

    window = optimizer._window
    state = {
        variable.name: getattr(window, variable.name)
        for variable in spec.window_state(optimizer.measure_noise_scale)
    }
    state["sums"] = window.sums
    return state


def parent_class(cls):
    """The Keras optimizer class an accumulating class was made from."""
    return cls.parent_class


def small_model_gradients(weights, x, y, coefficients):
    """The gradients of `sum_i coefficients[i] * l_i` over `small_model`'s
    weights (`get_weights()` order: kernel, bias, kernel, bias), `l_i` the
    mean squared error of sample i over its outputs: numpy, float64, by
    hand, so that an oracle needs neither the backend nor the library."""
    k1, b1, k2, b2 = (np.asarray(w, "float64") for w in weights)
    x, y = np.asarray(x, "float64"), np.asarray(y, "float64")
    hidden = np.tanh(x @ k1 + b1)
    # d l_i / d prediction = 2 (p - y) / outputs.
    upstream = (
        np.asarray(coefficients, "float64")[:, None]
        * 2.0
        * (hidden @ k2 + b2 - y)
        / y.shape[1]
    )
    before_tanh = (upstream @ k2.T) * (1.0 - hidden**2)
    return [
        x.T @ before_tanh,
        before_tanh.sum(0),
        hidden.T @ upstream,
        upstream.sum(0),
    ]


def small_embedding_model_gradients(weights, x, y, coefficients):
    """`small_model_gradients` for `small_embedding_model` (weights:
    embeddings, kernel, bias; `x` the tokens): numpy, float64, by hand."""
    table, kernel, bias = (np.asarray(w, "float64") for w in weights)
    tokens, y = np.asarray(x), np.asarray(y, "float64")
    pooled = table[tokens].mean(axis=1)
    upstream = (
        np.asarray(coefficients, "float64")[:, None]
        * 2.0
        * (pooled @ kernel + bias - y)
        / y.shape[1]
    )
    table_grad = np.zeros_like(table)
    per_token = (upstream @ kernel.T) / tokens.shape[1]
    for position in range(tokens.shape[1]):
        np.add.at(table_grad, tokens[:, position], per_token)
    return [table_grad, pooled.T @ upstream, upstream.sum(0)]


def _noise_terms(window, weights):
    """`(mean |g_j|^2, |g|^2, B_small, B_big)` of a window: its
    micro-batches' mean gradients `g_j` (lists of arrays) of weights `n_j`,
    and their weighted mean `g`, in float64."""
    weights = np.asarray(weights, "float64")
    sq_norms = [
        sum((np.asarray(g, "float64") ** 2).sum() for g in step)
        for step in window
    ]
    big_batch = weights.sum()
    mean = [
        sum(
            w * np.asarray(step[i], "float64")
            for w, step in zip(weights, window)
        )
        / big_batch
        for i in range(len(window[0]))
    ]
    small_batch = len(window) / (1.0 / weights).sum()
    big = sum((m**2).sum() for m in mean)
    return np.mean(sq_norms), big, small_batch, big_batch


def noise_estimates(window, weights):
    """The gradient noise scale's two unbiased estimates from one window
    (McCandlish et al. 2018, Appendix A; `_window/noise.py`), in float64:
    `(|G|^2, tr(Sigma))`, or NaNs for a window of one micro-batch.

    Args:
        window: its micro-batches' mean gradients, each a list of arrays
            (one per variable).
        weights: their weights `n_j` (1 each for unweighted windows).
    """
    if len(window) < 2:
        return np.nan, np.nan
    small, big, small_batch, big_batch = _noise_terms(window, weights)
    sq_norm = (big_batch * big - small_batch * small) / (
        big_batch - small_batch
    )
    trace = (small - big) / (1 / small_batch - 1 / big_batch)
    return sq_norm, trace


def noise_estimate_scales(window, weights):
    """The sizes of the terms `noise_estimates` takes differences of, for
    `(|G|^2, tr(Sigma))`: a float32 computation of either is off by its
    round-off relative to these, not to the (much smaller, where the
    terms nearly cancel) estimate. NaNs for a window of one micro-batch."""
    if len(window) < 2:
        return np.nan, np.nan
    small, big, small_batch, big_batch = _noise_terms(window, weights)
    gap = big_batch - small_batch
    return (
        (big_batch * big + small_batch * small) / gap,
        (small + big) * small_batch * big_batch / gap,
    )


def tensorboard_scalars(run_dir):
    """`{tag: [(step, value), ...]}` of the scalar summaries in a
    TensorBoard run (skips the test without the `tensorboard` package)."""
    import pytest

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    accumulator = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    return {
        tag: [
            (event.step, float(tensor_util.make_ndarray(event.tensor_proto)))
            for event in accumulator.Tensors(tag)
        ]
        for tag in accumulator.Tags()[event_accumulator.TENSORS]
    }
