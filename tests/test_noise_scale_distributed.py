"""The noise scale under `tf.distribute` (noise_mirrored_worker.py, a
`MirroredStrategy` over 2 CPU devices): each replica's share of a
micro-batch is one micro-batch of the window, a sample at `B_small` of its
own weight; the window's mean over every share is the sample at `B_big`
(see `_window/noise.py`).

The oracle: each window's two estimates recomputed in float64 numpy from
every share's mean gradient, which a plain Keras model (no strategy)
computes on the same samples at the weights the window started from; and
the moving averages and their ratio from those. The device split must
happen before TensorFlow starts, so the worker runs in a process of its
own, once, and these tests judge what it measured.

(keras.distribution: test_distribution_jax.py; torch `sync_windows`:
test_distribution_torch.py.)
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.backends("tensorflow")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("noise_mirrored") / "results.json"
    result = subprocess.run(
        [sys.executable, str(HERE / "noise_mirrored_worker.py"), str(out)],
        cwd=HERE,
        env=dict(
            os.environ,
            TF_CPP_MIN_LOG_LEVEL="3",
            KERAS_BACKEND="tensorflow",
            PYTHONPATH=os.pathsep.join(
                [str(HERE.parent), os.environ.get("PYTHONPATH", "")]
            ),
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["replicas"] == 2
    # The package of this checkout, not another installed one.
    assert Path(results["imported_from"]).is_relative_to(HERE.parent)
    return results


def _estimates(shares, variables=None):
    """The window's `(|G|^2, tr(Sigma))` in float64 from its shares
    (`(weight, gradients)`, `None` for weight 0), over `variables` (the
    indices of the variables counted; all by default)."""
    drawn = [(w, g) for w, g in shares if w > 0]
    if variables is None:
        variables = range(len(drawn[0][1]))
    weights = np.array([w for w, _ in drawn])
    flat = np.array(
        [
            np.concatenate([np.asarray(g[i], "float64") for i in variables])
            for _, g in drawn
        ]
    )
    small = np.mean((flat**2).sum(1))
    small_batch = len(drawn) / (1.0 / weights).sum()
    big_batch = weights.sum()
    big = ((weights @ flat / big_batch) ** 2).sum()
    sq_norm = (big_batch * big - small_batch * small) / (
        big_batch - small_batch
    )
    trace = (small - big) / (1 / small_batch - 1 / big_batch)
    return sq_norm, trace


def _assert_windows_match(windows, momentum, ours_of, variables=None):
    """Each window's estimates, their moving averages and `noise_scale`
    against numpy."""
    averages, total = np.zeros(2), 0.0
    for number, window in enumerate(windows):
        ours = ours_of(window)
        expected = np.array(_estimates(window["shares"], variables))
        actual = [ours["window_gradient_sq_norm"], ours["window_noise_trace"]]
        np.testing.assert_allclose(
            actual, expected, rtol=1e-4, atol=1e-5, err_msg=f"window {number}"
        )
        averages = momentum * averages + (1 - momentum) * expected
        total = momentum * total + (1 - momentum)
        np.testing.assert_allclose(
            [ours["gradient_sq_norm"], ours["gradient_noise_trace"]],
            averages / total,
            rtol=1e-3,
            atol=1e-5,
        )
        # Infinite while the averaged |G|^2 is not positive.
        noise_scale = averages[1] / averages[0] if averages[0] > 0 else np.inf
        np.testing.assert_allclose(ours["noise_scale"], noise_scale, rtol=2e-3)


def test_weighted_fit_with_a_skip_and_an_empty_share_matches_numpy(measured):
    """`weigh_micro_batches` in `fit`: shares weigh the sums of their
    sample weights; a micro-batch with a NaN in one replica's share is
    skipped by both; the flushed last window holds a share of one sample
    and an empty one (weight 0, no sample)."""
    result = measured["fit"]
    assert "error" not in result, result["error"]
    assert [len(s) for s in result["split"][-1]] == [1, 0]
    windows = result["windows"]
    _assert_windows_match(windows, measured["momentum"], lambda w: w["ours"])
    _assert_adascale_gains(windows, measured["fit_base_batch"])
    last = windows[-1]
    assert last["ours"]["iterations"] == 3
    assert last["ours"]["skipped_micro_batches"] == 1
    # The last window: 3 shares drawn of 4, one of them of one sample.
    assert sum(w > 0 for w, _ in last["shares"]) == 3
    # Weighted windows count every replica's samples (it counted their
    # mean over replicas, half of them).
    np.testing.assert_allclose(
        last["ours"]["samples_seen"],
        sum(w for window in windows for w, _ in window["shares"]),
        rtol=1e-6,
    )


def _assert_adascale_gains(windows, base):
    """Each window's AdaScale gain from its read-out averages and its
    samples (every replica's share), in numpy; the scale-invariant step
    their running sum."""
    tau = 0.0
    for number, window in enumerate(windows):
        ours = window["ours"]
        sq_norm = max(ours["gradient_sq_norm"], 0.0)
        trace = max(ours["gradient_noise_trace"], 0.0)
        samples = sum(w for w, _ in window["shares"])
        gain = (trace / base + sq_norm) / (trace / samples + sq_norm)
        gain = np.clip(gain, min(1, samples / base), max(1, samples / base))
        tau += gain
        np.testing.assert_allclose(
            [ours["adascale_gain"], ours["scale_invariant_step"]],
            [gain, tau],
            rtol=1e-4,
            err_msg=f"window {number}",
        )


def test_unweighted_custom_loop_counts_each_share_as_a_micro_batch(measured):
    result = measured["custom_loop"]
    assert "error" not in result, result["error"]
    windows = result["windows"]
    assert [len(w["shares"]) for w in windows] == [4, 4]  # 2 x 2 replicas
    _assert_windows_match(windows, measured["momentum"], lambda w: w["ours"][0])
    # Unweighted windows count global micro-batches: 2 per window.
    assert windows[-1]["ours"][0]["samples_seen"] == 4.0


def test_multi_optimizer_inner_optimizers_measure_their_own_variables(
    measured,
):
    result = measured["multi_optimizer"]
    assert "error" not in result, result["error"]
    biases = [i for i, p in enumerate(result["paths"]) if re.search("bias", p)]
    kernels = [i for i in range(len(result["paths"])) if i not in biases]
    assert biases and kernels
    for inner, variables in enumerate([kernels, biases]):
        _assert_windows_match(
            result["windows"],
            measured["momentum"],
            lambda w, inner=inner: w["ours"][inner],
            variables,
        )


def test_unweighted_adascale_counts_a_replica_s_share_as_its_unit(measured):
    """Unweighted, AdaScale's unit is the noise scale's: a replica's share
    of a micro-batch. `base_batch_size=2` (the replicas) is one global
    micro-batch, so windows of 2 micro-steps are `S = 2`: each window's
    gain, from its read-out averages with `S` = its shares (4) / 2, is
    numpy's, and each update moves the weights by `rate * gain` times the
    mean of its shares' gradients (numpy, from a plain model)."""
    result = measured["adascale_unweighted"]
    assert "error" not in result, result["error"]
    windows = result["windows"]
    replicas = measured["replicas"]
    assert [len(w["shares"]) for w in windows] == [2 * replicas] * 2
    _assert_windows_match(windows, measured["momentum"], lambda w: w["ours"][0])
    _assert_adascale_gains(
        [{**w, "ours": w["ours"][0]} for w in windows], base=replicas
    )
    gains = [w["ours"][0]["adascale_gain"] for w in windows]
    assert 1.0 <= min(gains) and max(gains) <= 2.0  # S = 2, not 4
    for window, gain in zip(windows, gains):
        grads = [g for _, g in window["shares"]]
        mean = [np.mean([g[i] for g in grads], 0) for i in range(len(grads[0]))]
        for start, end, grad in zip(window["start"], window["end"], mean):
            np.testing.assert_allclose(
                end,
                np.asarray(start) - measured["adascale_rate"] * gain * grad,
                rtol=1e-5,
                atol=1e-6,
            )


@pytest.mark.parametrize(
    "weighted", [False, True], ids=["unweighted", "weighted"]
)
def test_a_scaling_rule_counts_every_replica_s_share(measured, weighted):
    """A scaling rule's `S = window weight / base_batch_size` in the noise
    scale's unit: unweighted, a replica's share counts 1
    (`linear_scaling(base_batch_size=2)` on 2 replicas: windows of 2
    micro-steps are `S = 2`); weighted, every replica's samples (uneven
    shares, and a flushed window of one micro-batch). Each window's `S`,
    `tau` and update against numpy: `S` from the shares' weights, the
    rule's factor and the base schedule at `tau` read before the update,
    and the weights moved by that rate times the weighted mean of the
    shares' gradients (from a plain model)."""
    # (The worker's constants: importing it would start TensorFlow here.)
    rule = measured["rule"]
    rate0, decay = rule["rate"], rule["decay"]
    result = measured["rule_weighted" if weighted else "rule_unweighted"]
    assert "error" not in result, result["error"]
    windows = result["windows"]
    replicas = measured["replicas"]
    base = rule["weighted_base"] if weighted else replicas
    assert [len(w["shares"]) for w in windows] == (
        [4, 4, 2] if weighted else [4, 4]
    )
    tau = 0.0
    for number, window in enumerate(windows):
        weights = np.array([w for w, _ in window["shares"]])
        scale = weights.sum() / base
        if weighted:
            factor = np.sqrt(scale)
        else:
            factor = min(scale, 1 + (scale - 1) * min(1, tau / rule["warmup"]))
        rate = factor * rate0 * decay**tau
        tau += scale
        ours = window["ours"]
        np.testing.assert_allclose(
            [ours["window_scale"], ours["scale_invariant_step"]],
            [scale, tau],
            rtol=1e-6,
            err_msg=f"window {number}",
        )
        assert np.isnan(ours["adascale_gain"])  # AdaScale's only
        grads = [g for _, g in window["shares"]]
        for i, (start, end) in enumerate(zip(window["start"], window["end"])):
            mean = weights @ np.array([g[i] for g in grads]) / weights.sum()
            np.testing.assert_allclose(
                end,
                np.asarray(start) - rate * mean,
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"window {number}, variable {i}",
            )
    # Not the global micro-batch's count (S = 1) nor one replica's.
    expected = [16 / rule["weighted_base"]] * 2 + [8 / rule["weighted_base"]]
    np.testing.assert_allclose(
        [w["ours"]["window_scale"] for w in windows],
        expected if weighted else [2.0, 2.0],
        rtol=1e-6,
    )
