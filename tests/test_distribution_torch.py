"""Multi-process data parallelism on the torch backend.

Keras 3's `keras.distribution` API has no torch implementation: on torch,
`keras.src.backend.distribution_lib` is `None`, so every function that needs
the backend (`list_devices`, `get_device_count`, `initialize`,
`distribute_tensor`, a `DeviceMesh`'s `backend_mesh`, and `DataParallel()`
without devices, which lists them) raises `AttributeError: 'NoneType'
object has no attribute ...`. A `DataParallel` given an explicit device list
is accepted, can be set, and is then ignored: training runs on the one
process's device, unsharded. The first tests record both behaviours, and
that our optimizer under the ignored distribution trains as the parent does
on one device.

What Keras documents for several torch devices is its guide "Multi-GPU
distributed training with PyTorch": the Keras model (a `torch.nn.Module`)
wrapped in `torch.nn.parallel.DistributedDataParallel`, trained in a custom
torch loop. The other tests start 2 CPU processes of
`distribution_torch_worker.py` that do this over gloo on 127.0.0.1, with our
optimizer's `apply` in the loop, wait with a timeout and stop both on any
failure. The oracle is the parent Keras optimizer in this process, on the
global batch `accum_iters * per-rank batch * ranks`.

DDP all-reduces the gradients in every `backward`, so once per micro-step,
not once per window: accumulating over `K` micro-steps costs `K` gradient
all-reduces, as many as the parent optimizer without accumulation would
(`test_ddp_reduces_the_gradients_every_micro_step` records it). Each rank's
accumulator then holds gradients that are already global means, which is
why every rank applies the same window. DDP's `no_sync()` (skip the
all-reduce on the first `K - 1` micro-steps) does not compose with our
optimizer: on torch the accumulators are plain rank-local tensors that are
never reduced, so the unreduced micro-steps would make the ranks diverge.

`sync_windows` reduces the window's sums once per window, at the close, or
with `model=` behind the window's last backward (the overlap); both ways
are checked against the same oracle, against each other bit for bit, and
by their counted all-reduces, backward passes included.
"""

import keras
import numpy as np
import pytest
from helpers import assert_same_weights
from torch_ranks import parent_weights
from torch_ranks import run_ranks

pytestmark = pytest.mark.backends("torch")

CASES = ["adam", "sgd_nesterov_momentum"]


# -- keras.distribution on torch -------------------------------------------


def test_keras_distribution_has_no_torch_implementation():
    # AttributeError: the torch backend sets `distribution_lib = None`.
    with pytest.raises(
        AttributeError,
        match="'NoneType' object has no attribute 'list_devices'",
    ):
        keras.distribution.list_devices()
    with pytest.raises(
        AttributeError,
        match="'NoneType' object has no attribute 'list_devices'",
    ):
        keras.distribution.DataParallel()
    with pytest.raises(
        AttributeError,
        match="'NoneType' object has no attribute 'initialize'",
    ):
        keras.distribution.initialize()


def test_data_parallel_with_explicit_devices_is_ignored():
    # Accepted (nothing checks the devices: torch has no "cpu:1"), set, and
    # then never consulted: the model trains unsharded on one device, and
    # our optimizer trains as the parent does with the global batch.
    from helpers import PARENTS
    from helpers import regression_data
    from helpers import small_model

    from accum_optimizers import AdamAccumulate

    k, micro_batch = 3, 8
    x, y = regression_data(5, 2 * k * micro_batch)
    distribution = keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
    with distribution.scope():
        assert keras.distribution.distribution() is distribution
        model = small_model(0)
        optimizer = AdamAccumulate(0.01, accum_iters=k)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=micro_batch, shuffle=False, verbose=0)
    assert keras.distribution.distribution() is None
    for variable in model.variables + optimizer.variables:
        assert getattr(variable, "_layout", None) is None, variable.path
    with pytest.raises(
        AttributeError,
        match="'NoneType' object has no attribute 'distribute_tensor'",
    ):
        keras.distribution.distribute_tensor(
            x, distribution.get_data_layout(x.shape)
        )
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 2

    parent = small_model(0)
    parent.compile(optimizer=PARENTS[AdamAccumulate](0.01), loss="mse")
    parent.fit(x, y, batch_size=k * micro_batch, shuffle=False, verbose=0)
    assert_same_weights(model, parent, rtol=1e-5, atol=1e-6)


# -- DistributedDataParallel over 2 processes --------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from distribution_torch_worker import WORLD_SIZE

    out = tmp_path_factory.mktemp("ddp")
    run_ranks(out, WORLD_SIZE)
    results = [dict(np.load(out / f"rank{r}.npz")) for r in range(WORLD_SIZE)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert result["world_size"] == WORLD_SIZE
    return results


@pytest.mark.parametrize("case", CASES)
def test_ddp_equals_one_process_global_batch(ranks, case):
    from distribution_torch_worker import WINDOWS

    chief = ranks[0]
    expected = parent_weights(case)
    for i, weight in enumerate(expected):
        np.testing.assert_allclose(
            chief[f"{case}_w{i}"], weight, rtol=1e-5, atol=1e-6
        )
    assert chief[f"{case}_iterations"] == WINDOWS


@pytest.mark.parametrize("case", CASES)
def test_ddp_ranks_end_with_the_same_state(ranks, case):
    from distribution_torch_worker import WINDOWS
    from distribution_torch_worker import K

    chief, other = ranks
    for key in chief:
        if key.startswith(f"{case}_w"):
            np.testing.assert_array_equal(other[key], chief[key])
    for result in ranks:
        assert result[f"{case}_iterations"] == WINDOWS
        assert result[f"{case}_micro_batches_seen"] == K * WINDOWS
        assert result[f"{case}_micro_steps"] == 0


@pytest.mark.parametrize("case", CASES)
def test_ddp_reduces_the_gradients_every_micro_step(ranks, case):
    # One bucket for this small model: one all-reduce per backward.
    from distribution_torch_worker import WINDOWS
    from distribution_torch_worker import K

    for result in ranks:
        assert result[f"{case}_reductions"] == K * WINDOWS


# -- Once per window: no_sync() and sync_windows ------------------------------


# `windows`: the exchange at the close; `overlap`: `sync_windows(model=)`,
# the exchange started during the window's last backward.
SYNC_WAYS = ["windows", "overlap"]


@pytest.mark.parametrize("way", SYNC_WAYS)
@pytest.mark.parametrize("case", CASES)
def test_sync_windows_equals_one_process_global_batch(ranks, case, way):
    from distribution_torch_worker import WINDOWS

    for result in ranks:
        for i, weight in enumerate(parent_weights(case)):
            np.testing.assert_allclose(
                result[f"{case}_{way}_w{i}"], weight, rtol=1e-5, atol=1e-6
            )
        assert result[f"{case}_{way}_iterations"] == WINDOWS
        assert result[f"{case}_{way}_micro_steps"] == 0


@pytest.mark.parametrize("way", SYNC_WAYS)
@pytest.mark.parametrize("case", CASES)
def test_sync_windows_ranks_are_bit_identical(ranks, case, way):
    chief, other = ranks
    keys = [k for k in chief if k.startswith(f"{case}_{way}_w")]
    assert keys
    for key in keys:
        np.testing.assert_array_equal(other[key], chief[key])


@pytest.mark.parametrize("case", CASES)
def test_overlap_equals_the_exchange_at_the_close_bit_for_bit(ranks, case):
    # The same additions in the same order: only when they run differs.
    for result in ranks:
        keys = [k for k in result if k.startswith(f"{case}_windows_w")]
        for key in keys:
            np.testing.assert_array_equal(
                result[key.replace("_windows_", "_overlap_")], result[key]
            )


@pytest.mark.parametrize("case", CASES)
def test_sync_windows_reduces_once_per_window(ranks, case):
    # No gradient all-reduce in any backward (every one under no_sync), and
    # one all-reduce per window (the small model's sums fit one bucket).
    from distribution_torch_worker import WINDOWS

    for result in ranks:
        assert result[f"{case}_windows_reductions"] == 0
        assert result[f"{case}_windows_all_reduces"] == WINDOWS
        # Without sync_windows the optimizer itself never all-reduces.
        assert result[f"{case}_all_reduces"] == 0


@pytest.mark.parametrize("case", CASES)
def test_overlap_reduces_once_per_bucket_per_window(ranks, case):
    # Counted over whole windows, backward passes included: one all-reduce
    # per bucket in each window's last backward (2 buckets here, launched
    # in one order on both ranks), and one of two scalars at the close (the
    # loss sum and the total weight, which only `apply` brings); none in
    # DDP's hooks and none on the other micro-steps.
    from distribution_torch_worker import OVERLAP_BUCKETS
    from distribution_torch_worker import WINDOWS

    for result in ranks:
        assert result[f"{case}_overlap_reductions"] == 0
        assert result[f"{case}_overlap_all_reduces"] == (
            (OVERLAP_BUCKETS + 1) * WINDOWS
        )
        # The buckets' all-reduces start inside the last backward.
        assert result[f"{case}_overlap_all_reduces_in_backward"] == (
            OVERLAP_BUCKETS * WINDOWS
        )
        assert result[f"{case}_windows_all_reduces_in_backward"] == 0


@pytest.mark.parametrize("prefix", ["", "overlap_"])
def test_sync_windows_flush_applies_the_global_partial_window(ranks, prefix):
    # Oracle: the parent on one process, on the 2 global micro-batches the
    # flushed window holds.
    from distribution_torch_worker import DATA_SEED
    from distribution_torch_worker import GLOBAL_MICRO
    from distribution_torch_worker import N
    from helpers import regression_data
    from helpers import small_model

    x, y = regression_data(DATA_SEED, N)
    model = small_model(0)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(
        x[: 2 * GLOBAL_MICRO],
        y[: 2 * GLOBAL_MICRO],
        batch_size=2 * GLOBAL_MICRO,
        shuffle=False,
        verbose=0,
    )
    for result in ranks:
        for i, weight in enumerate(model.get_weights()):
            np.testing.assert_allclose(
                result[f"{prefix}flush_w{i}"], weight, rtol=1e-5, atol=1e-6
            )
        assert result[f"{prefix}flush_iterations"] == 1


@pytest.mark.parametrize("prefix", ["", "overlap_"])
def test_sync_windows_flush_discards_a_window_non_finite_on_one_rank(
    ranks, prefix
):
    # Rank 1's micro-batch is NaN: every rank discards the window (none
    # waits in the all-reduce), and the weights stay the flushed ones.
    chief, other = ranks
    for result in ranks:
        assert result[f"{prefix}flush_nan_iterations"] == 1
        assert result[f"{prefix}flush_nan_micro_steps"] == 0
        for key in result:
            if key.startswith(f"{prefix}flush_nan_w"):
                flushed = result[key.replace("flush_nan_w", "flush_w")]
                np.testing.assert_array_equal(result[key], flushed)
    for key in chief:
        if key.startswith(f"{prefix}flush"):
            np.testing.assert_array_equal(other[key], chief[key])


@pytest.mark.parametrize("prefix", ["skip", "overlap_skip"])
def test_sync_windows_skips_a_micro_batch_non_finite_on_one_rank(ranks, prefix):
    # Oracle: the parent on one process, on the global micro-batches the
    # window holds once the skipped micro-step (NaN on rank 1 only) is left
    # out: mid-window, or with the overlap the window's last one, whose
    # exchange had already started.
    from distribution_torch_worker import DATA_SEED
    from distribution_torch_worker import GLOBAL_MICRO
    from distribution_torch_worker import OVERLAP_SKIPPED
    from distribution_torch_worker import SKIPPED
    from distribution_torch_worker import K
    from distribution_torch_worker import N
    from helpers import regression_data
    from helpers import small_model

    skipped = OVERLAP_SKIPPED if prefix == "overlap_skip" else SKIPPED
    x, y = regression_data(DATA_SEED, N)
    kept = np.concatenate(
        [
            np.arange(step * GLOBAL_MICRO, (step + 1) * GLOBAL_MICRO)
            for step in range(K + 1)
            if step != skipped
        ]
    )
    model = small_model(0)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(
        x[kept], y[kept], batch_size=K * GLOBAL_MICRO, shuffle=False, verbose=0
    )
    chief, other = ranks
    for result in ranks:
        for i, weight in enumerate(model.get_weights()):
            np.testing.assert_allclose(
                result[f"{prefix}_w{i}"], weight, rtol=1e-5, atol=1e-6
            )
        assert result[f"{prefix}_iterations"] == 1
        assert result[f"{prefix}_skipped_micro_batches"] == 1
        assert result[f"{prefix}_micro_steps"] == 0
    for key in chief:
        if key.startswith(f"{prefix}_w"):
            np.testing.assert_array_equal(other[key], chief[key])


def test_overlap_refuses_other_gradients_and_weights_changing_nothing(ranks):
    # On the window's last micro-step, after its backward started the
    # exchange: `apply` with copies of the gradients, then with a
    # `weight`, raises and leaves the window pending; the right call then
    # closes it as the parent on the global batch.
    from distribution_torch_worker import DATA_SEED
    from distribution_torch_worker import GLOBAL_MICRO
    from distribution_torch_worker import K
    from distribution_torch_worker import N
    from helpers import regression_data
    from helpers import small_model

    x, y = regression_data(DATA_SEED, N)
    model = small_model(0)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    window = K * GLOBAL_MICRO
    model.fit(
        x[:window], y[:window], batch_size=window, shuffle=False, verbose=0
    )
    for result in ranks:
        assert "must receive the `.grad`" in str(result["refused_copies"])
        assert "sync_windows(model=...)" in str(result["refused_weight"])
        assert result["refused_copies_micro_steps"] == K - 1
        assert result["refused_weight_micro_steps"] == K - 1
        assert result["refused_iterations"] == 1
        for i, weight in enumerate(model.get_weights()):
            np.testing.assert_allclose(
                result[f"refused_w{i}"], weight, rtol=1e-5, atol=1e-6
            )


def heads_on_window_means(pattern):
    """The oracle of `reached_heads`: Adam in one process, each window
    updating every variable some rank's micro-batch reached (a head counts
    zero where a micro-batch does not reach it), with the mean of every
    rank's micro-batch gradients weighted as the ranks weigh them."""
    import torch
    from distribution_torch_worker import MISSING_STEPS
    from distribution_torch_worker import MISSING_WINDOWS
    from distribution_torch_worker import WORLD_SIZE
    from distribution_torch_worker import K
    from distribution_torch_worker import N
    from distribution_torch_worker import heads_loss
    from distribution_torch_worker import heads_model
    from distribution_torch_worker import missing_rows
    from distribution_torch_worker import reached
    from helpers import regression_data

    x, y = regression_data(5, N)
    model = heads_model(x.shape[1])
    variables = model.trainable_variables
    parent = keras.optimizers.Adam(0.01)
    parent.build(variables)
    for window in range(MISSING_WINDOWS + 1):  # the last one flushed
        sums = [np.zeros(tuple(v.shape), "float64") for v in variables]
        total, updated = 0.0, set()
        for step in range(window * K, min((window + 1) * K, MISSING_STEPS)):
            for rank in range(WORLD_SIZE):
                weight = 2.0 + rank
                xb, _ = missing_rows(x, y, step, rank)
                loss = heads_loss(model, xb, reached(pattern, rank, step))
                params = [v.value for v in variables]
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for i, grad in enumerate(grads):
                    if grad is not None:
                        updated.add(i)
                        sums[i] += weight * grad.numpy().astype("float64")
                total += weight
        indices = sorted(updated)
        parent.apply(
            [
                keras.ops.convert_to_tensor((sums[i] / total).astype("float32"))
                for i in indices
            ],
            [variables[i] for i in indices],
        )
    return model.get_weights()


def test_ranks_whose_none_gradients_differ_update_as_the_big_batch(ranks):
    # The named pattern (a head missing from one rank's closing call only,
    # reached by one rank's first micro-step only, reached by no one) and
    # the drawn ones, a flushed partial window last; at the close and with
    # the overlap, on both ranks:
    # the big batch's update, the ranks identical bit for bit.
    from distribution_torch_worker import DRAWS
    from distribution_torch_worker import MISSING_WINDOWS

    chief, other = ranks
    for pattern in ("named",) + DRAWS:
        expected = heads_on_window_means(pattern)
        for result in ranks:
            for way in ("windows", "overlap"):
                prefix = f"reached_{pattern}_{way}"
                assert result[f"{prefix}_iterations"] == MISSING_WINDOWS + 1
                for i, weight in enumerate(expected):
                    np.testing.assert_allclose(
                        result[f"{prefix}_w{i}"],
                        weight,
                        rtol=1e-5,
                        atol=1e-6,
                        err_msg=f"{prefix} weight {i}",
                    )
    for key in chief:
        if key.startswith("reached_"):
            np.testing.assert_array_equal(other[key], chief[key])


def test_overlap_weighted_uneven_shards_equal_one_process_global_batch(
    ranks,
):
    # Each global micro-batch split 3/5 over the ranks, weighed by the row
    # counts announced before each backward: the window's mean is the
    # global batch's, as with even shards.
    from distribution_torch_worker import WINDOWS

    chief, other = ranks
    for result in ranks:
        for i, weight in enumerate(parent_weights("adam")):
            np.testing.assert_allclose(
                result[f"weighted_overlap_w{i}"], weight, rtol=1e-5, atol=1e-6
            )
        assert result["weighted_overlap_iterations"] == WINDOWS
    for key in chief:
        if key.startswith("weighted_overlap_w"):
            np.testing.assert_array_equal(other[key], chief[key])


def test_sync_windows_measures_the_noise_scale_and_adascale_s_gain(ranks):
    # Oracle: the paper's estimates in numpy, every rank's micro-batch a
    # small batch and the window over all ranks the big one.
    from distribution_torch_worker import WORLD_SIZE
    from distribution_torch_worker import K
    from distribution_torch_worker import noise_gradients

    draws = [
        noise_gradients(rank, step)
        for rank in range(WORLD_SIZE)
        for step in range(K)
    ]
    weights = np.asarray([w for _, w in draws])
    sq_norms = [
        sum((g.astype("float64") ** 2).sum() for g in grads)
        for grads, _ in draws
    ]
    small = np.mean(sq_norms)
    big_batch = weights.sum()
    small_batch = len(draws) / (1.0 / weights).sum()
    big = sum(
        (
            (
                sum(w * grads[i].astype("float64") for grads, w in draws)
                / big_batch
            )
            ** 2
        ).sum()
        for i in range(len(draws[0][0]))
    )
    sq_norm = (big_batch * big - small_batch * small) / (
        big_batch - small_batch
    )
    trace = (small - big) / (1 / small_batch - 1 / big_batch)
    # AdaScale's gain of the one window, from the averages (after one
    # window, its estimates) and the window's weight over every rank.
    from distribution_torch_worker import NOISE_BASE_BATCH

    base = NOISE_BASE_BATCH
    gain = (max(trace, 0) / base + max(sq_norm, 0)) / (
        max(trace, 0) / big_batch + max(sq_norm, 0)
    )
    gain = float(np.clip(gain, 1.0, big_batch / base))
    assert gain > 1.0
    for result in ranks:
        np.testing.assert_allclose(
            [
                result["noise_window_gradient_sq_norm"],
                result["noise_window_noise_trace"],
                result["noise_adascale_gain"],
                result["noise_scale_invariant_step"],
            ],
            [sq_norm, trace, gain, gain],
            rtol=2e-4,
        )


@pytest.mark.parametrize("kind", ["unweighted", "weighted"])
def test_sync_windows_scaling_rules_count_every_rank_s_micro_batches(
    ranks, kind
):
    """A scaling rule's `S = window weight / base_batch_size` over every
    rank: each rank's micro-batch counts 1 unweighted (`linear_scaling`,
    2 ranks x K micro-steps over a base of 2 micro-batches), its weight
    weighted (`sqrt_scaling`). Oracle: numpy, from the numpy gradients
    every rank applied: `S`, `tau`, the rule's factor on the base schedule
    at `tau`, and SGD's step with the window's weighted mean gradient;
    every rank bit-identical."""
    from distribution_torch_worker import RULE_BASES
    from distribution_torch_worker import RULE_DECAY
    from distribution_torch_worker import RULE_RATE
    from distribution_torch_worker import RULE_WARMUP
    from distribution_torch_worker import WORLD_SIZE
    from distribution_torch_worker import K
    from distribution_torch_worker import noise_gradients

    weighted = kind == "weighted"
    chief = ranks[0]
    variables = len(noise_gradients(0, 0)[0])
    weights = [chief[f"rule_{kind}_w0_{i}"] for i in range(variables)]
    weights = [w.astype("float64") for w in weights]
    tau, scales, steps = 0.0, [], []
    for window in range(2):
        draws = [
            noise_gradients(rank, step)
            for rank in range(WORLD_SIZE)
            for step in range(window * K, (window + 1) * K)
        ]
        counts = np.asarray([w if weighted else 1.0 for _, w in draws])
        scale = counts.sum() / RULE_BASES[kind]
        if weighted:
            factor = np.sqrt(scale)
        else:
            factor = min(scale, 1 + (scale - 1) * min(1, tau / RULE_WARMUP))
        rate = factor * RULE_RATE * RULE_DECAY**tau
        for i in range(variables):
            mean = sum(
                c * g[i].astype("float64") for c, (g, _) in zip(counts, draws)
            )
            weights[i] = weights[i] - rate * mean / counts.sum()
            np.testing.assert_allclose(
                chief[f"rule_{kind}_w{window + 1}_{i}"],
                weights[i],
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"window {window}, variable {i}",
            )
        tau += scale
        scales.append(scale)
        steps.append(tau)
    np.testing.assert_allclose(chief[f"rule_{kind}_scales"], scales, rtol=1e-6)
    np.testing.assert_allclose(chief[f"rule_{kind}_steps"], steps, rtol=1e-6)
    if not weighted:
        assert scales == [WORLD_SIZE * K / RULE_BASES[kind]] * 2  # not K / 2
    for other in ranks[1:]:
        for key in chief:
            if key.startswith(f"rule_{kind}_"):
                np.testing.assert_array_equal(other[key], chief[key], key)
