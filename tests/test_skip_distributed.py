"""`skip_nonfinite` across devices: a micro-batch non-finite on one
replica is left out on all of them.

- `tf.distribute.MirroredStrategy` over 2 CPU devices
  (skip_mirrored_worker.py), in a graph: the replicas agree with an
  all-reduce of the check;
- `keras.distribution.DataParallel` over 2 JAX CPU devices: the gradients
  are global arrays, so is the check.

(torch ranks under `sync_windows`: test_distribution_torch.py.) The oracle
is the parent Keras optimizer on one device on the big batches made of the
remaining micro-batches.
"""

import pytest
from helpers import run_jax_worker
from helpers import run_mirrored_worker

# Same weights up to float32 round-off of a differently ordered sum.
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    out = tmp_path_factory.mktemp("skip_mirrored") / "results.json"
    return run_mirrored_worker("skip_mirrored_worker.py", out)


def _assert_skipped_everywhere(result):
    assert "error" not in result, result["error"]
    assert result["max_difference"] < TOLERANCE
    assert result["scale"] > 1000 * TOLERANCE
    assert result["skipped_micro_batches"] == 1
    assert result["iterations"] == result["expected_iterations"]
    assert result["micro_steps"] == result["expected_micro_steps"]


@pytest.mark.backends("tensorflow")
def test_mirrored_replicas_skip_together(mirrored):
    _assert_skipped_everywhere(mirrored["graph"])


@pytest.mark.backends("jax")
def test_data_parallel_skips_a_micro_batch_non_finite_on_one_device(tmp_path):
    result = run_jax_worker(
        "skip_dataparallel_worker.py", tmp_path / "results.json", 2
    )
    _assert_skipped_everywhere(result)
