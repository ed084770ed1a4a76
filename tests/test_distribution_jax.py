"""Our optimizers under `keras.distribution` over two JAX CPU devices.

Two JAX devices exist only if `XLA_FLAGS` asks for them before JAX starts,
so one subprocess (distribution_jax_worker.py) trains every case and these
tests judge what it wrote, each against its own oracle:

- weights: `fit` under `DataParallel` (and `ModelParallel`) on global
  micro-batches of b, accumulated over k, ends with the weights and
  optimizer state of the parent Keras optimizer trained on one device on
  batches of k*b, in the same order;
- layout: every accumulator has its variable's sharding and Keras layout,
  which is what Keras gives the parent's own slots (Adam's moments, ...),
  and our counters are placed like `iterations`;
- counters: `iterations` counts windows and no micro-batch is left pending;
- scaling rules: a window's `S` counts global micro-batches (or samples,
  weighted), and the weights are the parent's whose schedule is the rule's
  at `tau = S * n`.

Runs once, from the JAX test process.
"""

from pathlib import Path

import numpy as np
import pytest
from distribution_jax_worker import ACCUM_ITERS
from distribution_jax_worker import CASES
from distribution_jax_worker import DEVICE_COUNT
from distribution_jax_worker import RULE_SCALES
from distribution_jax_worker import WINDOWS
from helpers import assert_all_close
from helpers import run_jax_worker

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.backends("jax")

WEIGHT_CASES = [name for name, case in CASES.items() if case.compare_weights]
MODEL_PARALLEL_CASES = [
    name for name, case in CASES.items() if case.distribution == "model"
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What the worker wrote, by case name (see distribution_jax_worker)."""
    result_path = tmp_path_factory.mktemp("distribution") / "result.json"
    return run_jax_worker(
        "distribution_jax_worker.py", result_path, DEVICE_COUNT
    )


def test_every_case_ran_distributed_against_a_single_device_oracle(
    results,
):
    assert set(results) == set(CASES)
    for name, result in results.items():
        assert result["parent_device_count"] == 1, name
        for stage in ("after_build", "after_fit"):
            for entry in result[stage]["per_variable"]:
                assert entry["variable"]["device_count"] == DEVICE_COUNT, (
                    f"{name}: {entry['path']} is not on every device"
                )
        if CASES[name].distribution == "data":
            # DataParallel splits each global micro-batch over the devices.
            assert result["data_layout_axes"] == ["batch", None], name


def _float32(values):
    return [np.asarray(value, dtype="float32") for value in values]


def _state_by_parent_path(result, key):
    """The optimizer variables `result[key]` (`[path, value]` pairs) as
    float32 arrays, keyed by the parent's paths: ours are named otherwise,
    in the same order."""
    paths = [path for path, _ in result["parent_state"]]
    assert len(set(paths)) == len(paths) == len(result[key])
    values = _float32(value for _, value in result[key])
    return dict(zip(paths, values))


@pytest.mark.parametrize("name", WEIGHT_CASES)
def test_fit_under_distribution_equals_parent_on_one_device(results, name):
    """Weights and the parent's optimizer variables (moments, ...) agree.

    rtol/atol as in helpers.assert_same_state, for the same reason.
    """
    result = results[name]
    tolerance = dict(rtol=1e-4, atol=1e-6)
    assert_all_close(
        _float32(result["our_weights"]),
        _float32(result["parent_weights"]),
        what=f"{name}: weight",
        **tolerance,
    )
    assert_all_close(
        _state_by_parent_path(result, "our_state"),
        _state_by_parent_path(result, "parent_state"),
        what=f"{name}: optimizer variable",
        **tolerance,
    )


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("stage", ["after_build", "after_fit"])
def test_optimizer_variables_are_laid_out_like_their_variables(
    results, name, stage
):
    """Our accumulators pass the check the parent's own slots pass.

    Keras creates each slot (`add_variable_from_reference`) with its
    variable's layout; our accumulator is held to the same: same Keras
    layout (axes and mesh) and an equivalent JAX sharding.
    """
    placements = results[name][stage]
    for entry in placements["per_variable"]:
        variable = entry["variable"]
        assert "accumulator" in entry["slots"]
        assert len(entry["slots"]) >= 2, "no parent slot to compare with"
        for kind, slot in entry["slots"].items():
            where = f"{name} {stage}: {kind} of {entry['path']}"
            assert slot["equivalent"], (
                f"{where} is sharded as {slot['sharding']}, its variable "
                f"as {variable['sharding']}"
            )
            assert slot["sharding"] == variable["sharding"], where
            assert slot["layout_axes"] == variable["layout_axes"], where
            assert slot["layout_mesh"] == variable["layout_mesh"], where
    scalars = placements["scalars"]
    for counter in ("micro_steps", "micro_batches"):
        assert scalars[counter] == scalars["iterations"], (
            f"{name} {stage}: {counter} is placed as {scalars[counter]}, "
            f"`iterations` as {scalars['iterations']}"
        )


@pytest.mark.parametrize("name", MODEL_PARALLEL_CASES)
def test_model_parallel_layout_check_is_not_vacuous(results, name):
    """Some kernel is really sharded, so "same layout" means something."""
    specs = [
        entry["variable"]["layout_axes"]
        for entry in results[name]["after_build"]["per_variable"]
    ]
    assert any("model" in (axes or []) for axes in specs), specs


@pytest.mark.parametrize("name", list(CASES))
def test_iterations_count_windows_and_none_is_pending(results, name):
    result = results[name]
    assert result["iterations"] == WINDOWS
    assert result["parent_iterations"] == WINDOWS
    assert result["micro_steps"] == 0
    assert result["micro_batches_seen"] == WINDOWS * ACCUM_ITERS


def test_the_noise_scale_and_adascale_under_data_parallel_are_one_device_s(
    results,
):
    # Programs see global arrays: each micro-batch is the global one, and
    # the measurement is what the same run on one device measures.
    from distribution_jax_worker import NOISE_READOUTS

    result = results["sgd_adascale_noise_scale"]
    noise = result["noise"]
    for name in NOISE_READOUTS:
        assert np.isfinite(noise[name]), (name, noise)
        np.testing.assert_allclose(
            noise[name], noise[f"one_device_{name}"], rtol=1e-4, err_msg=name
        )
    # AdaScale scaled the updates (a gain above 1) as on one device.
    assert noise["adascale_gain"] > 1.0
    for ours, alone in zip(result["our_weights"], noise["one_device_weights"]):
        np.testing.assert_allclose(ours, alone, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", list(RULE_SCALES))
def test_a_scaling_rule_under_data_parallel_counts_global_micro_batches(
    results, name
):
    """Programs see global arrays: a window weighs its global
    micro-batches unweighted (`linear_scaling(base_batch_size=1)`, Adam,
    `S = 3`), its samples weighted (`sqrt_scaling`, SGD with momentum,
    `S = 12 / 8`). `test_fit_under_distribution_equals_parent_on_one_device`
    checks the weights against the parent whose schedule is the rule's at
    `tau = S * n`; here `S` and `tau` themselves."""
    rule = results[name]["rule"]
    scale = RULE_SCALES[name]
    np.testing.assert_allclose(
        [rule["window_scale"], rule["scale_invariant_step"]],
        [scale, WINDOWS * scale],
        rtol=1e-6,
    )
