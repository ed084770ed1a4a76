"""Saved states of an earlier version restore exactly, mid-window.

`data/saved_states/<backend>/` holds states that the code before the
window-record rewrite wrote on each backend (frozen: see its README), each
with 2 micro-batches pending: `fit` (`AdamAccumulate(accum_iters=3)` under
`model.fit`) and `loop` (`accum_iters=4`, `measure_noise_scale`,
`skip_nonfinite`, a custom loop of weighted `apply` calls with a skipped
micro-batch and variables left out), as `.keras`, `.weights.h5` and, on
TensorFlow, `tf.train.Checkpoint` files. Each is loaded on this backend,
whichever wrote it: every optimizer variable must come back as saved (the
count of refused normalizers, added since, as 0), and
the window it holds, finished with its recorded micro-batches, must give
the weights of the oracle, the parent Keras `Adam` applied to each
window's weighted mean gradient from the initial weights.
"""

import keras
import numpy as np
import pytest
from helpers import TESTS
from helpers import assert_all_close
from helpers import noise_estimate_scales
from helpers import noise_estimates
from helpers import parent_on_window_means
from helpers import small_model
from helpers import small_model_gradients
from helpers import to_numpy

from accum_optimizers import AdamAccumulate

DATA = TESTS / "data" / "saved_states"
BACKENDS = ("jax", "tensorflow", "torch")
LEARNING_RATE = 0.05
# The configurations the states were saved with (`make.py`'s).
CONFIGS = {
    "fit": {"accum_iters": 3},
    "loop": {
        "accum_iters": 4,
        "measure_noise_scale": True,
        "skip_nonfinite": True,
    },
}
# The weights, against the oracle's: float32 round-off between a window's
# mean and the oracle's float64 one, which Adam's division by the root of
# the second moment turns into up to ~1e-4 relative (see
# `helpers.assert_same_state`); a lost or wrong piece of the saved window
# moves them by lr * |g| ~ 1e-2.
RTOL, ATOL = 1e-4, 1e-6


def _cases():
    for backend in BACKENDS:
        for config in CONFIGS:
            for kind in ("keras", "weights", "checkpoint"):
                marks = ()
                if kind == "checkpoint":
                    if backend != "tensorflow":
                        continue  # written on TensorFlow alone
                    marks = pytest.mark.backends("tensorflow")
                yield pytest.param(
                    backend,
                    config,
                    kind,
                    id=f"{backend}-{config}-{kind}",
                    marks=marks,
                )


def _compiled(config):
    model = small_model(0)
    model.compile(
        optimizer=AdamAccumulate(LEARNING_RATE, **CONFIGS[config]), loss="mse"
    )
    model.optimizer.build(model.trainable_variables)
    return model


def _load(backend, config, kind):
    stem = DATA / backend / config
    if kind == "keras":
        return keras.saving.load_model(f"{stem}.keras")
    model = _compiled(config)
    if kind == "weights":
        model.load_weights(f"{stem}.weights.h5")
    else:
        import tensorflow as tf

        # `read`, the counterpart of the `write` that wrote it: `restore`
        # also expects the `save_counter` that only `save` writes. The
        # count of refused normalizers, added since, has no saved value:
        # the test checks every variable against the saved values instead.
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
            f"{stem}_ckpt"
        ).expect_partial()
    return model


def _arrays(saved, prefix, count=None):
    """`saved[prefix + "0"]`, `saved[prefix + "1"]`, ... (all of them, or
    `count` with `None` for a missing one: a variable left out)."""
    if count is None:
        count = sum(1 for key in saved.files if key.startswith(prefix))
        assert count, prefix
    return [saved.get(f"{prefix}{i}") for i in range(count)]


def _finish(model, saved):
    """`apply` of the recorded micro-batches that finish the window."""
    variables = model.trainable_variables
    weights, losses = saved["finish_weight"], saved["finish_loss"]
    for n, (weight, loss) in enumerate(zip(weights, losses)):
        grads = _arrays(saved, f"finish_grad_{n}_", len(variables))
        model.optimizer.apply(
            [
                None if g is None else keras.ops.convert_to_tensor(g)
                for g in grads
            ],
            variables,
            weight=None if np.isnan(weight) else float(weight),
            loss=float(loss),
        )


def _oracle_of_fit(saved):
    """The parent on the big batches of the `fit` run, its gradients
    worked out in numpy at its own weights (`small_model_gradients`).
    Returns its variables and the last window's loss."""
    b = int(saved["batch_size"])
    x, y = saved["x"], saved["y"]
    variables = [keras.Variable(w) for w in _arrays(saved, "initial_")]
    parent = keras.optimizers.Adam(LEARNING_RATE)
    k = CONFIGS["fit"]["accum_iters"]
    for start in range(0, len(x), k * b):
        weights = to_numpy(variables)
        window, losses = [], []
        for j in range(start, start + k * b, b):
            xb, yb = x[j : j + b], y[j : j + b]
            window.append(small_model_gradients(weights, xb, yb, [1 / b] * b))
            hidden = np.tanh(xb @ weights[0] + weights[1])
            losses.append(np.mean((hidden @ weights[2] + weights[3] - yb) ** 2))
        parent_on_window_means(parent, variables, [window])
    return variables, float(np.mean(losses))


def _windows_of_loop(saved, variable_count):
    """The loop's micro-steps that entered a window, in windows:
    `(grads, weights, losses)` of each."""
    k = CONFIGS["loop"]["accum_iters"]
    steps = [
        (_arrays(saved, f"step_grad_{n}_", variable_count), weight, loss)
        for n, (weight, loss, skipped) in enumerate(
            zip(saved["step_weight"], saved["step_loss"], saved["step_skipped"])
        )
        if not skipped
    ]
    assert len(steps) % k == 0, len(steps)
    return [
        tuple(map(list, zip(*steps[i : i + k])))
        for i in range(0, len(steps), k)
    ]


@pytest.mark.parametrize("backend, config, kind", list(_cases()))
def test_a_state_saved_mid_window_by_the_earlier_code_restores_exactly(
    backend, config, kind
):
    saved = np.load(DATA / backend / f"{config}.npz")
    model = _load(backend, config, kind)
    optimizer = model.optimizer
    assert type(optimizer) is AdamAccumulate
    assert optimizer.accum_iters == CONFIGS[config]["accum_iters"]

    # Every saved variable comes back as saved; the count of refused
    # normalizers, added since, starts at 0.
    added = [v for v in optimizer.variables if v.name == "accum_refused"]
    assert [int(to_numpy(v)) for v in added] == [0]
    assert_all_close(
        [v for v in optimizer.variables if v.name != "accum_refused"],
        _arrays(saved, "opt_"),
        rtol=0,
        atol=0,
        what="optimizer variable",
    )
    assert_all_close(
        model.get_weights(), _arrays(saved, "model_"), rtol=0, atol=0
    )
    assert int(optimizer.micro_steps) == 2
    assert int(optimizer.iterations) == 2

    _finish(model, saved)
    assert int(optimizer.micro_steps) == 0
    assert int(optimizer.iterations) == 3
    variable_count = len(model.trainable_variables)
    if config == "fit":
        oracle, window_loss = _oracle_of_fit(saved)
        samples = 3 * CONFIGS["fit"]["accum_iters"]  # micro-batches of 1
        assert int(optimizer.micro_batches_seen) == samples
    else:
        windows = _windows_of_loop(saved, variable_count)
        oracle = [keras.Variable(w) for w in _arrays(saved, "initial_")]
        parent_on_window_means(
            keras.optimizers.Adam(LEARNING_RATE),
            oracle,
            [grads for grads, _, _ in windows],
            [weights for _, weights, _ in windows],
        )
        _, weights, losses = windows[-1]
        window_loss = np.average(losses, weights=weights)
        samples = sum(float(np.sum(w)) for _, w, _ in windows)
        assert int(optimizer.micro_batches_seen) == 12
        assert int(optimizer.skipped_micro_batches) == 1
        _assert_noise_read_outs(optimizer, windows, variable_count)
    assert_all_close(model.trainable_variables, oracle, rtol=RTOL, atol=ATOL)
    assert float(optimizer.samples_seen) == samples
    np.testing.assert_allclose(float(optimizer.window_loss), window_loss, 1e-5)


def _assert_noise_read_outs(optimizer, windows, variable_count):
    """The last window's noise estimates and the moving averages over the
    three windows, against `helpers.noise_estimates` (a left-out gradient
    counts zero), to float32 round-off of the terms they are differences
    of (`noise_estimate_scales`)."""
    momentum = optimizer.noise_scale_momentum
    averages, average_bounds, total = np.zeros(2), np.zeros(2), 0.0
    for grads, weights, _ in windows:
        window = [
            [
                np.zeros(shape) if g is None else g
                for g, shape in zip(step, _shapes(windows, variable_count))
            ]
            for step in grads
        ]
        estimates = np.asarray(noise_estimates(window, weights))
        bounds = 1e-5 * np.asarray(noise_estimate_scales(window, weights))
        averages = momentum * averages + (1 - momentum) * estimates
        average_bounds = momentum * average_bounds + (1 - momentum) * bounds
        total = momentum * total + (1 - momentum)
    for read, expected, bound in [
        (
            [optimizer.window_gradient_sq_norm, optimizer.window_noise_trace],
            estimates,
            bounds,
        ),
        (
            [optimizer.gradient_sq_norm, optimizer.gradient_noise_trace],
            averages / total,
            average_bounds / total,
        ),
    ]:
        read = np.asarray([float(r) for r in read])
        assert np.all(np.abs(read - expected) <= bound), (read, expected)


def _shapes(windows, variable_count):
    """Each variable's shape, from a micro-step that has its gradient."""
    shapes = [None] * variable_count
    for grads, _, _ in windows:
        for step in grads:
            for i, g in enumerate(step):
                if g is not None:
                    shapes[i] = g.shape
    return shapes
