"""`keras.distribution.ModelParallel` on a 2x4 mesh of JAX CPU devices.

One subprocess (model_parallel_jax_worker.py, 8 devices from `XLA_FLAGS`)
trains the parent Adam on the k-times-larger batch and `AdamAccumulate`
under the same distribution; these tests judge what it wrote:

- ours ends with the parent's weights (the oracle: Keras' own Adam under
  the same `ModelParallel`, on batches of k*b);
- the kernels really are sharded over "model";
- on every device, our optimizer holds the parent's state plus the sums,
  and the sums take exactly the bytes of the model's shard there (plus two
  int32 and a float32 counter per device), the memory bound per device.
"""

from pathlib import Path

import numpy as np
import pytest
from helpers import run_jax_worker

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.backends("jax")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from model_parallel_jax_worker import DEVICE_COUNT

    path = tmp_path_factory.mktemp("model_parallel") / "result.json"
    return run_jax_worker("model_parallel_jax_worker.py", path, DEVICE_COUNT)


def test_model_parallel_equals_parent_on_the_big_batch(result):
    from model_parallel_jax_worker import WINDOWS

    assert result["iterations"] == result["parent_iterations"] == WINDOWS
    for index, (actual, expected) in enumerate(
        zip(result["our_weights"], result["parent_weights"], strict=True)
    ):
        np.testing.assert_allclose(
            np.asarray(actual, "float32"),
            np.asarray(expected, "float32"),
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"weight {index}",
        )


def test_kernels_are_sharded_over_the_model_axis(result):
    assert len(result["kernel_shardings"]) == 2
    for sharding in result["kernel_shardings"]:
        assert "'model'" in sharding, sharding


def test_extra_bytes_per_device_are_the_models_shard(result):
    from model_parallel_jax_worker import DEVICE_COUNT

    model, sums = result["model_bytes"], result["sums_bytes"]
    assert len(model) == DEVICE_COUNT
    # Sharded: a device holds less than the whole model.
    assert max(model) < result["model_total_bytes"]
    assert sums == model
    counters = 4 + 4 + 4  # micro_steps, micro_batches (int32), total weight
    seen = None  # the per-variable "seen" flags: a few bytes, replicated
    for parent, ours, shard in zip(
        result["parent_state_bytes"], result["our_state_bytes"], model
    ):
        extra = ours - parent - shard - counters
        seen = extra if seen is None else seen
        assert extra == seen and 0 <= extra <= 64, (parent, ours, shard)


def test_an_optimizer_made_outside_the_scope_is_refused(result):
    # Its counters live on one device; the compiled train step refuses them.
    assert "incompatible devices" in result["made_outside"]
