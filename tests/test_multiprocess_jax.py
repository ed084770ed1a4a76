"""Our optimizers under `keras.distribution` across two JAX processes.

Two processes (multiprocess_jax_worker.py) join over 127.0.0.1 with
`keras.distribution.initialize` and JAX's gloo CPU collectives, and train
under `DataParallel` over both processes' devices, each feeding its own
shard of every global micro-batch, in one launch. This process judges
what they wrote against the parent Keras optimizer trained here, in one
plain process, on the big batch of `K` global micro-batches:

- plain windows end with the parent's weights;
- a NaN in one process's shard of one micro-batch is skipped by both
  processes (`skip_nonfinite`), and the run is the parent's on the others;
- weighted windows (`weigh_micro_batches`, sample weights that differ
  between micro-batches) end with the parent's weights;
- the processes' weights are bit-identical in every run;
- the `.keras` file process 0 saved mid-window resumes, in this process,
  where it was: continued on the remaining micro-batches it ends where the
  uninterrupted two-process run ended.

Skipped where this jaxlib has no CPU collectives.
"""

import json

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import small_model
from jax_processes import run_jax_processes
from multiprocess_jax_worker import DEVICES_PER_PROCESS
from multiprocess_jax_worker import GLOBAL_MICRO
from multiprocess_jax_worker import LEARNING_RATE
from multiprocess_jax_worker import MID_WINDOW_AT
from multiprocess_jax_worker import NO_COLLECTIVES_EXIT
from multiprocess_jax_worker import POISONED
from multiprocess_jax_worker import PROCESSES
from multiprocess_jax_worker import SEED
from multiprocess_jax_worker import WINDOWS
from multiprocess_jax_worker import K
from multiprocess_jax_worker import global_data
from multiprocess_jax_worker import loss_of

pytestmark = pytest.mark.backends("jax")

RUNS = ("plain", "skip", "weighted")
DEVICES = PROCESSES * DEVICES_PER_PROCESS
# Both sides add the same float32 numbers in another order (the big batch
# at once against per-process shards all-reduced), which Adam magnifies up
# to ~1e-4 relative in a small component (helpers.assert_same_state).
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`(records per process, out_dir)`: what the workers wrote."""
    out_dir = tmp_path_factory.mktemp("multiprocess")
    run_jax_processes(
        "multiprocess_jax_worker.py",
        out_dir,
        processes=PROCESSES,
        devices_per_process=DEVICES_PER_PROCESS,
        timeout=150,
        unavailable_exit=NO_COLLECTIVES_EXIT,
    )
    records = [
        json.loads((out_dir / f"process{i}.json").read_text())
        for i in range(PROCESSES)
    ]
    return records, out_dir


def float32(weights):
    return [np.asarray(w, dtype="float32") for w in weights]


def parent_weights(run):
    """The oracle: Keras' Adam in this process, on one device, on batches of
    `K` global micro-batches; `skip` without its poisoned micro-batch."""
    x, y, sample_weight = global_data(run)
    if run == "skip":
        kept = np.ones(len(x), bool)
        kept[POISONED * GLOBAL_MICRO : (POISONED + 1) * GLOBAL_MICRO] = False
        x, y = x[kept], y[kept]
    model = small_model(SEED)
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE), loss=loss_of(run)
    )
    model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=K * GLOBAL_MICRO,
        shuffle=False,
        verbose=0,
    )
    assert int(model.optimizer.iterations) == WINDOWS
    return model.get_weights()


def test_each_run_spans_every_process_and_closes_every_window(launched):
    records, _ = launched
    for process_id, record in enumerate(records):
        for run in RUNS:
            where = f"process {process_id}, {run}"
            assert record[run]["device_count"] == DEVICES, where
            assert record[run]["iterations"] == WINDOWS, where
            assert record[run]["micro_steps"] == 0, where


@pytest.mark.parametrize("run", RUNS)
def test_processes_end_with_bit_identical_weights(launched, run):
    records, _ = launched
    first = float32(records[0][run]["weights"])
    for process_id, record in enumerate(records[1:], start=1):
        for index, (ours, theirs) in enumerate(
            zip(float32(record[run]["weights"]), first)
        ):
            np.testing.assert_array_equal(
                ours,
                theirs,
                err_msg=f"{run}: weight {index}, process {process_id} "
                "against process 0",
            )


@pytest.mark.parametrize("run", RUNS)
def test_two_processes_equal_the_parent_on_the_big_batch(launched, run):
    records, _ = launched
    assert_all_close(
        float32(records[0][run]["weights"]),
        parent_weights(run),
        rtol=RTOL,
        atol=ATOL,
        what=f"{run} weight",
    )


def test_both_processes_skip_the_micro_batch_one_of_them_poisoned(launched):
    records, _ = launched
    assert [record["skip"]["skipped_micro_batches"] for record in records] == [
        1
    ] * PROCESSES
    for record in records:
        assert record["plain"]["skipped_micro_batches"] == 0


def test_weighted_windows_are_not_vacuous():
    """Micro-batches of one window weigh differently, so an unweighed
    window would not be the parent's big batch."""
    _, _, sample_weight = global_data("weighted")
    sums = sample_weight.reshape(WINDOWS, K, GLOBAL_MICRO).sum(axis=-1)
    assert all(len(set(window)) > 1 for window in sums.tolist()), sums


def test_saved_mid_window_by_process_0_resumes_in_one_process(launched):
    records, out_dir = launched
    assert records[0]["plain"]["saved_micro_steps"] == MID_WINDOW_AT % K
    assert MID_WINDOW_AT % K > 0  # mid-window, or the test proves little
    model = keras.saving.load_model(out_dir / "0-mid_window.keras")
    assert int(model.optimizer.micro_steps) == MID_WINDOW_AT % K
    x, y, _ = global_data("plain")
    rest = slice(MID_WINDOW_AT * GLOBAL_MICRO, None)
    model.fit(
        x[rest], y[rest], batch_size=GLOBAL_MICRO, shuffle=False, verbose=0
    )
    assert int(model.optimizer.iterations) == WINDOWS
    assert int(model.optimizer.micro_steps) == 0
    assert_all_close(
        model.get_weights(),
        float32(records[0]["plain"]["weights"]),
        rtol=RTOL,
        atol=ATOL,
        what="resumed weight",
    )
