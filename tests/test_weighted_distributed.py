"""Weighted windows across devices equal the one-device big batch.

Micro-batches that differ (a short last micro-batch, sample weights,
masked variable-length sequences) weighed by their loss normalizers, by
`weigh_micro_batches` in `fit` or by `apply(weight=...)` in a custom loop,
over 2 CPU devices:

- `tf.distribute.MirroredStrategy` (weighted_mirrored_worker.py): each
  replica weighs its own shard; the weights are summed over replicas with
  the gradients once per window;
- `keras.distribution.DataParallel` on JAX
  (weighted_dataparallel_worker.py): arrays are global, and so is each
  micro-batch's normalizer.

The oracle is always the parent Keras optimizer on one device, from the
same initial weights, on each window's concatenated big batch. The device
split must happen before the backend starts, so each worker runs in a
process of its own, once, and these tests judge what it measured.
"""

import pytest
from helpers import run_jax_worker
from helpers import run_mirrored_worker

# Same weights up to float32 round-off of a differently ordered sum.
TOLERANCE = 1e-6
WINDOWS = 2  # a full window, then a flushed partial one
K = 3


def _windows(per_micro_batch):
    return [
        per_micro_batch[start : start + K]
        for start in range(0, len(per_micro_batch), K)
    ]


def _assert_equals_big_batch(result):
    assert "error" not in result, result["error"]
    assert result["max_difference"] < TOLERANCE
    assert result["iterations"] == WINDOWS
    # The weights moved far more than the tolerance.
    assert result["scale"] > 1000 * TOLERANCE


# -- tf.distribute.MirroredStrategy ------------------------------------------


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    return run_mirrored_worker(
        "weighted_mirrored_worker.py",
        tmp_path_factory.mktemp("weighted_mirrored") / "results.json",
    )


FIT_CASE_NAMES = [
    "sample_weight_sum_over_batch_size_empty_replica",
    "sample_weight_mean_with_sample_weight",
    "masked_sequences",
]
FIT_CASES = FIT_CASE_NAMES[:2] + ["masked_sequences"]


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("case", FIT_CASE_NAMES)
def test_each_window_holds_exactly_its_big_batch(mirrored, case):
    """`fit` deals each global micro-batch to the replicas in order, the
    first replicas taking one more sample of a short one: a window's
    shards are the oracle's big batch, whatever the split."""
    split = mirrored[f"fit/{case}"]["split"]
    samples = [i for batch in split for shard in batch for i in shard]
    assert samples == list(range(len(samples)))
    last = [len(shard) for shard in split[-1]]
    assert last == ([1, 0] if "empty_replica" in case else [3, 2])
    # The normalizers differ: an unweighed window would not be exact.
    normalizers = mirrored[f"fit/{case}"]["normalizers"]
    assert any(
        len({n for b in w for n in b}) > 1 for w in _windows(normalizers)
    )


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("case", FIT_CASES)
def test_mirrored_fit_weighs_micro_batches_as_the_big_batch(mirrored, case):
    result = mirrored[f"fit/{case}"]
    _assert_equals_big_batch(result)
    assert result["oracle_iterations"] == WINDOWS


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize(
    "kind",
    ["dense", "sequences"],
)
def test_mirrored_custom_loop_with_uneven_replica_weights(mirrored, kind):
    """`strategy.run` of a step passing each replica's own count (samples,
    or valid tokens) as `weight`, with shards of different sizes."""
    _assert_equals_big_batch(mirrored[f"custom_loop/{kind}"])


# -- keras.distribution.DataParallel (JAX) -----------------------------------


@pytest.mark.backends("tensorflow")
def test_drawn_mirrored_custom_loops_match_the_reference_after_every_step(
    tmp_path,
):
    # Drawn sequences (weighed micro-steps with a weight and gradients per
    # replica, 0 for an empty share, `None` gradients, flushes), checked
    # in the worker after every step against the parent on one device fed
    # each window's global weighted mean: weights, `iterations`,
    # `samples_seen` (every replica's weights) and `micro_steps`.
    results = run_mirrored_worker(
        "weighted_mirrored_machine_worker.py", tmp_path / "results.json"
    )
    assert results["sequences"] >= 2 and results["steps"] >= 12, results


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory):
    results = run_jax_worker(
        "weighted_dataparallel_worker.py",
        tmp_path_factory.mktemp("weighted_data_parallel") / "results.json",
        2,
        timeout=600,
    )
    assert results["devices"] == 2
    return results


@pytest.mark.backends("jax")
@pytest.mark.parametrize(
    "case",
    [
        "sample_weight_sum_over_batch_size",
        "sample_weight_mean_with_sample_weight",
        "masked_sequences",
    ],
)
def test_data_parallel_fit_weighs_micro_batches_as_the_big_batch(
    data_parallel, case
):
    result = data_parallel[case]
    # Each global micro-batch is split over the devices.
    assert result["data_layout_axes"][0] == "batch"
    windows = _windows(result["normalizers"])
    assert any(len(set(window)) > 1 for window in windows)
    _assert_equals_big_batch(result)
    assert result["oracle_iterations"] == WINDOWS
