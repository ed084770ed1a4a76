"""`AccumulationLogger`: applied updates and the pending window in `fit`'s
logs (History, progress bar) and in TensorBoard event files.

The expected values are counted by hand: `fit` over `N` micro-batches with
`accum_iters=K` has applied `n // K` updates after micro-batch `n`, with
`n % K` pending."""

import importlib.util
import sys

import keras
import numpy as np
import pytest
from helpers import regression_data
from helpers import small_model
from helpers import tensorboard_scalars

from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import _tensorboard

K, B, BATCHES = 2, 2, 5  # An epoch of 5 micro-batches leaves 1 pending.


class _BatchLogs(keras.callbacks.Callback):
    """Records the logs that callbacks listed after the logger receive."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))


def _fit(callbacks, epochs=2, optimizer=None, verbose=0):
    x, y = regression_data(3, BATCHES * B)
    model = small_model(3)
    optimizer = optimizer or AdamAccumulate(accum_iters=K)
    model.compile(optimizer=optimizer, loss="mse")
    return model.fit(
        x,
        y,
        batch_size=B,
        epochs=epochs,
        shuffle=False,
        verbose=verbose,
        callbacks=callbacks,
    )


def test_history_records_updates_and_pending_micro_steps_per_epoch():
    history = _fit([AccumulationLogger()], epochs=3)
    # After 5, 10, 15 micro-batches: 2, 5, 7 updates; 1, 0, 1 pending.
    assert history.history["updates"] == [2, 5, 7]
    assert history.history["micro_steps"] == [1, 0, 1]


def test_history_counts_the_window_flushed_before_it():
    history = _fit([FlushAccumulation(), AccumulationLogger()], epochs=2)
    # Each epoch: windows of 2, 2 and a flushed 1.
    assert history.history["updates"] == [3, 6]
    assert history.history["micro_steps"] == [0, 0]


def test_batch_logs_carry_updates_for_the_progress_bar():
    recorder = _BatchLogs()
    _fit([AccumulationLogger(update_freq="batch"), recorder])
    n = np.arange(1, 2 * BATCHES + 1)
    assert [logs["updates"] for logs in recorder.batches] == list(n // K)
    assert [logs["micro_steps"] for logs in recorder.batches] == list(n % K)


def test_update_freq_logs_every_nth_batch_only():
    recorder = _BatchLogs()
    _fit([AccumulationLogger(update_freq=3), recorder], epochs=1)
    assert ["updates" in logs for logs in recorder.batches] == [
        False,
        False,
        True,
        False,
        False,
    ]
    assert recorder.batches[2]["updates"] == 3 // K


def test_progress_bar_shows_updates(capsys):
    _fit([AccumulationLogger()], epochs=1, verbose=2)
    out = capsys.readouterr().out
    assert "updates: 2.0000" in out
    assert "micro_steps: 1.0000" in out


def test_event_file_has_the_scalars_with_step_applied_updates(tmp_path):
    _fit([AccumulationLogger(log_dir=tmp_path, batch_size=B)], epochs=2)
    scalars = tensorboard_scalars(tmp_path / "train")
    # One point per epoch end: after 5 and 10 micro-batches.
    assert scalars.pop("accumulation/skipped_micro_batches") == [
        (2, 0.0),
        (5, 0.0),
    ]
    # Unweighted windows count micro-batches: K per applied window.
    assert scalars.pop("accumulation/samples_seen") == [
        (2, 2.0 * K),
        (5, 5.0 * K),
    ]
    for name in ("window_loss", "window_grad_norm"):
        points = scalars.pop(f"accumulation/{name}")
        assert [step for step, _ in points] == [2, 5]
        assert all(np.isfinite(value) and value > 0 for _, value in points)
    assert scalars == {
        "accumulation/updates": [(2, 2.0), (5, 5.0)],
        "accumulation/micro_batches": [(2, 5.0), (5, 10.0)],
        "accumulation/window_fill": [(2, 1 / K), (5, 0.0)],
        "accumulation/effective_batch_size": [(2, K * B), (5, K * B)],
    }


def test_event_file_gets_a_point_after_each_applied_update(tmp_path):
    _fit([AccumulationLogger(log_dir=tmp_path, update_freq=1)], epochs=1)
    scalars = tensorboard_scalars(tmp_path / "train")
    assert "accumulation/effective_batch_size" not in scalars  # No batch_size.
    # Micro-batches 2 and 4 (updates), then the epoch's end with
    # micro-batch 5 pending at the same step as micro-batch 4; none after
    # micro-batch 1, before any update.
    assert scalars["accumulation/micro_batches"] == [
        (1, 2.0),
        (2, 4.0),
        (2, 5.0),
    ]
    assert scalars["accumulation/window_fill"] == [
        (1, 0.0),
        (2, 0.0),
        (2, 0.5),
    ]
    for name in ("window_loss", "window_grad_norm"):
        points = scalars[f"accumulation/{name}"]
        assert [step for step, _ in points] == [1, 2, 2]
        assert all(value > 0 for _, value in points), points


def test_event_file_has_no_point_before_the_first_update(tmp_path):
    # One epoch of 5 micro-batches, windows of 8: nothing is applied.
    logger = AccumulationLogger(log_dir=tmp_path, update_freq="batch")
    optimizer = AdamAccumulate(accum_iters=8, measure_noise_scale=True)
    with pytest.warns(UserWarning, match="5 micro-batches of a window"):
        _fit([logger], epochs=1, optimizer=optimizer)
    assert tensorboard_scalars(tmp_path / "train") == {}


def test_scalars_sit_next_to_keras_tensorboardtensorboard_scalars(tmp_path):
    pytest.importorskip("tensorflow")  # Keras' TensorBoard callback needs it.
    callbacks = [
        AccumulationLogger(log_dir=tmp_path),
        keras.callbacks.TensorBoard(log_dir=tmp_path, write_graph=False),
    ]
    _fit(callbacks, epochs=1)
    scalars = tensorboard_scalars(tmp_path / "train")
    assert scalars["accumulation/updates"] == [(2, 2.0)]
    assert [step for step, _ in scalars["epoch_loss"]] == [0]
    # Keras' callback, listed after ours, also writes our logs entries.
    assert scalars["epoch_updates"] == [(0, 2.0)]


def test_tf_summary_writes_the_same_scalars_without_tensorboard(
    tmp_path, monkeypatch
):
    pytest.importorskip("tensorflow")
    reference = tmp_path / "tensorboard"
    _fit([AccumulationLogger(log_dir=reference, batch_size=B)], epochs=2)
    expected = tensorboard_scalars(reference / "train")
    # `None` in sys.modules makes `import tensorboard.summary` fail.
    monkeypatch.setitem(sys.modules, "tensorboard.summary", None)
    with pytest.raises(ImportError):
        _tensorboard._TensorBoardWriter(str(tmp_path / "unused"))
    fallback = tmp_path / "tf"
    _fit([AccumulationLogger(log_dir=fallback, batch_size=B)], epochs=2)
    monkeypatch.undo()
    assert tensorboard_scalars(fallback / "train") == expected


def test_log_dir_without_tensorboard_or_tensorflow_is_an_import_error(
    monkeypatch,
):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        AccumulationLogger(log_dir="logs")
    AccumulationLogger()  # Logs only: nothing to import.


def test_loss_scale_optimizer_is_unwrapped():
    keras.config.set_dtype_policy("mixed_float16")
    history = _fit([AccumulationLogger()], epochs=1)
    assert history.history["updates"] == [2]


def test_non_accumulating_optimizer_is_refused():
    with pytest.raises(ValueError, match="accumulating optimizer"):
        _fit([AccumulationLogger()], optimizer=keras.optimizers.SGD())


def test_accum_iters_1_logs_every_micro_batch_as_an_update():
    history = _fit(
        [AccumulationLogger()], epochs=1, optimizer=SGDAccumulate(0.01)
    )
    assert history.history["updates"] == [BATCHES]
    assert history.history["micro_steps"] == [0]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "8"}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"update_freq": 0}, "update_freq"),
        ({"update_freq": "step"}, "update_freq"),
        ({"update_freq": 2.0}, "update_freq"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs, name):
    (value,) = kwargs.values()
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        AccumulationLogger(**kwargs)


def test_config_round_trips(tmp_path):
    logger = AccumulationLogger(
        log_dir=tmp_path, batch_size=np.int64(16), update_freq="batch"
    )
    config = logger.get_config()
    assert config == {
        "log_dir": str(tmp_path),
        "batch_size": 16,
        "update_freq": 1,
    }
    assert type(config["batch_size"]) is int
    assert AccumulationLogger(**config).get_config() == config
