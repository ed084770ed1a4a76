"""Windows that grow to the measured noise scale
(`schedules.by_noise_scale`).

Oracles: the schedule's map from noise scale to window by hand; the parent
Keras optimizer fed the big batches a `by_noise_scale` run chose, with its
learning rate set at the same sample counts; the uninterrupted run, for a
model saved mid-window and loaded.
"""

import keras
import numpy as np
import pytest
from helpers import assert_same_weights
from helpers import regression_data
from helpers import small_model
from helpers import to_numpy

from accum_optimizers import AccumulationLogger
from accum_optimizers import SGDAccumulate
from accum_optimizers import schedules
from accum_optimizers import weigh_micro_batches


def _value(tensor):
    return float(to_numpy(tensor))


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"micro_batch_size": 0}, "micro_batch_size=0"),
        ({"micro_batch_size": 8, "floor": 1}, "floor=1"),
        ({"micro_batch_size": 8, "floor": 4, "ceiling": 3}, "ceiling=3"),
        ({"micro_batch_size": 8, "grow_only": "yes"}, "grow_only='yes'"),
        ({"micro_batch_size": 8, "warmup_windows": -1}, "warmup_windows=-1"),
    ],
)
def test_by_noise_scale_refuses_bad_arguments_by_name(arguments, match):
    with pytest.raises((TypeError, ValueError), match=match):
        schedules.by_noise_scale(**arguments)


def test_by_noise_scale_maps_the_noise_scale_to_a_window():
    schedule = schedules.by_noise_scale(8, floor=2, ceiling=6)
    for noise_scale, expected in (
        (float("nan"), 2),
        (0.0, 2),
        (-5.0, 2),
        (17.0, 3),
        (40.0, 5),
        (1e9, 6),
        (float("inf"), 6),
    ):
        assert int(to_numpy(schedule(noise_scale))) == expected, noise_scale
    config = keras.saving.serialize_keras_object(schedule)
    assert keras.saving.deserialize_keras_object(config).get_config() == (
        schedule.get_config()
    )


def test_fit_with_windows_that_grow_to_the_noise_scale_equals_the_parent():
    """`by_noise_scale` with a per-sample learning rate: the sizes the run
    chose, read from the logger's `samples_seen`, replayed as big batches
    by the parent with its learning rate set at the same sample counts."""
    batch = 2
    x, y = regression_data(5, 120)
    decay = keras.optimizers.schedules.ExponentialDecay(0.05, 40, 0.7)
    model = small_model(0)
    ours = SGDAccumulate(
        learning_rate=schedules.by_samples(decay),
        accum_iters=schedules.by_noise_scale(
            batch, floor=2, ceiling=8, warmup_windows=3
        ),
        measure_noise_scale=True,
        noise_scale_momentum=0.5,
    )
    model.compile(optimizer=ours, loss="mse")
    weigh_micro_batches(model)
    logger = AccumulationLogger(update_freq="batch")
    model.fit(
        x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[logger]
    )
    seen = [0.0] + logger.windows["samples_seen"]
    sizes = [int(b - a) for a, b in zip(seen, seen[1:])]
    assert len(set(sizes)) > 1, sizes  # the windows grew
    assert sizes == sorted(sizes)  # and only grew
    assert logger.windows["noise_scale"][-1] == _value(ours.noise_scale)
    reference = small_model(0)
    parent = keras.optimizers.SGD(learning_rate=0.05)
    reference.compile(optimizer=parent, loss="mse")
    start = 0
    for size in sizes:
        parent.learning_rate = float(to_numpy(decay(float(start))))
        reference.train_on_batch(
            x[start : start + size], y[start : start + size]
        )
        start += size
    assert_same_weights(model, reference)


def test_a_keras_file_resumes_a_window_sized_by_the_noise_scale(tmp_path):
    """Saved mid-window under `by_noise_scale`: the loaded model's window
    has the size the saved measurement gives, and it continues as the
    uninterrupted run (the oracle: that run, in the same process)."""
    x, y = regression_data(8, 96)

    def make():
        model = small_model(0)
        model.compile(
            optimizer=SGDAccumulate(
                learning_rate=0.05,
                accum_iters=schedules.by_noise_scale(
                    1, floor=2, ceiling=5, warmup_windows=2
                ),
                measure_noise_scale=True,
                noise_scale_momentum=0.5,
            ),
            loss="mse",
        )
        return model

    whole = make()
    whole.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    first = make()
    first.fit(x[:44], y[:44], batch_size=4, shuffle=False, verbose=0)
    assert int(to_numpy(first.optimizer.micro_steps)) > 0  # mid-window
    path = tmp_path / "model.keras"
    first.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.measure_noise_scale is True
    assert loaded.optimizer.current_accum_iters == (
        first.optimizer.current_accum_iters
    )
    loaded.fit(x[44:], y[44:], batch_size=4, shuffle=False, verbose=0)
    assert_same_weights(loaded, whole, rtol=1e-5, atol=1e-6)
    for name in ("noise_scale", "window_noise_trace", "iterations"):
        np.testing.assert_allclose(
            _value(getattr(loaded.optimizer, name)),
            _value(getattr(whole.optimizer, name)),
            rtol=1e-5,
        )
