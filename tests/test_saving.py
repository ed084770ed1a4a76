"""Saving and loading: `.keras` files, `custom_objects`, resuming mid-window."""

import json
import zipfile

import keras
import pytest
from helpers import PARENTS
from helpers import assert_all_close
from helpers import assert_same_weights
from helpers import fit_in_order
from helpers import fit_interrupted
from helpers import regression_data
from helpers import small_model

from accum_optimizers import AdamAccumulate
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate

OPTIONS = {
    AdamAccumulate: {"amsgrad": True},
    SGDAccumulate: {"momentum": 0.9, "learning_rate": 0.05},
    RMSpropAccumulate: {"centered": True, "momentum": 0.5},
}


def _compiled(cls, accum_iters=4):
    model = small_model(3)
    model.compile(
        optimizer=cls(accum_iters=accum_iters, **OPTIONS[cls]), loss="mse"
    )
    return model


def _assert_resumed_like_uninterrupted(restored, uninterrupted):
    assert_same_weights(restored, uninterrupted, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("custom_objects", [False, True])
@pytest.mark.parametrize("cls", list(PARENTS))
def test_keras_file_saved_mid_window_resumes_like_uninterrupted_run(
    cls, custom_objects, tmp_path
):
    k, b = 4, 2
    x, y = regression_data(5, 2 * k * b)
    uninterrupted, interrupted = fit_interrupted(
        lambda: _compiled(cls, k), x, y, 6 * b, b
    )
    assert int(interrupted.optimizer.iterations) == 1  # 2 of 4 pending
    path = tmp_path / "mid_window.keras"
    interrupted.save(path)
    objects = {cls.__name__: cls} if custom_objects else None
    restored = keras.saving.load_model(path, custom_objects=objects)

    assert type(restored.optimizer) is cls
    assert restored.optimizer.accum_iters == k
    assert_all_close(
        restored.optimizer.variables,
        interrupted.optimizer.variables,
        rtol=0,
        atol=0,
        what="optimizer variable",
    )

    fit_in_order(restored, x[6 * b :], y[6 * b :], batch_size=b)
    assert int(restored.optimizer.iterations) == 2
    _assert_resumed_like_uninterrupted(restored, uninterrupted)
    assert_all_close(
        restored.optimizer.variables,
        uninterrupted.optimizer.variables,
        rtol=1e-6,
        atol=1e-7,
        what="optimizer variable",
    )


@pytest.mark.parametrize(
    "saved_iters, loaded_iters", [(4, 1), (1, 4)], ids=["4->1", "1->4"]
)
def test_a_state_saved_between_windows_loads_into_another_accum_iters(
    saved_iters, loaded_iters, tmp_path
):
    x, y = regression_data(0, 8)
    saved = _compiled(AdamAccumulate, saved_iters)
    fit_in_order(saved, x, y, batch_size=2)
    path = tmp_path / "state.weights.h5"
    saved.save_weights(path)

    other = _compiled(AdamAccumulate, loaded_iters)
    other.optimizer.build(other.trainable_variables)
    other.load_weights(path)
    assert int(other.optimizer.iterations) == int(saved.optimizer.iterations)
    assert int(other.optimizer.micro_steps) == 0
    probe = _compiled(AdamAccumulate, 1)  # the parent's state alone
    probe.optimizer.build(probe.trainable_variables)
    parent_state = len(probe.optimizer.variables)
    assert parent_state > 2  # moments included
    assert_all_close(
        other.optimizer.variables[:parent_state],
        saved.optimizer.variables[:parent_state],
        rtol=0,
        atol=0,
        what="optimizer variable",
    )


def test_loading_state_of_another_configuration_fails_loudly(tmp_path):
    x, y = regression_data(0, 8)
    saved = _compiled(AdamAccumulate, 4)  # amsgrad=True
    saved.fit(x, y, batch_size=2, verbose=0)
    path = tmp_path / "state.weights.h5"
    saved.save_weights(path)

    other = small_model(3)
    other.compile(optimizer=AdamAccumulate(accum_iters=4), loss="mse")
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(ValueError, match="different optimizer or config"):
        other.load_weights(path)


@pytest.mark.parametrize("bad", [2.0, "2", True], ids=repr)
def test_an_edited_keras_file_with_a_bad_accum_iters_says_so_first(
    bad, tmp_path
):
    # Keras buries a `TypeError` of `from_config` at the end of its generic
    # "could not be deserialized properly" message; the reason must lead.
    saved = tmp_path / "saved.keras"
    _compiled(AdamAccumulate, 4).save(saved)
    edited = tmp_path / "edited.keras"
    with zipfile.ZipFile(saved) as source:
        files = {name: source.read(name) for name in source.namelist()}
    config = json.loads(files["config.json"])
    config["compile_config"]["optimizer"]["config"]["accum_iters"] = bad
    files["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(edited, "w") as target:
        for name, content in files.items():
            target.writestr(name, content)
    with pytest.raises(ValueError) as raised:
        keras.saving.load_model(edited)
    first_line = str(raised.value).splitlines()[0]
    assert first_line.startswith("`accum_iters` must be an integer >= 1")
    assert f"accum_iters={bad!r}" in first_line, first_line
    assert "AccumSchedule" in first_line, first_line


def test_loading_plain_keras_adam_state_into_accumulating_fails_loudly(
    tmp_path,
):
    x, y = regression_data(0, 8)
    saved = small_model(3)
    saved.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    saved.fit(x, y, batch_size=2, verbose=0)
    path = tmp_path / "adam.weights.h5"
    saved.save_weights(path)

    other = _compiled(AdamAccumulate, 4)
    other.optimizer.build(other.trainable_variables)
    saved_count = len(saved.optimizer.variables)
    with pytest.raises(ValueError, match=f"holds {saved_count} optimizer var"):
        other.load_weights(path)


@pytest.mark.parametrize("weights_only", [False, True], ids=["keras", "h5"])
@pytest.mark.parametrize("cls", list(PARENTS), ids=lambda c: c.__name__)
def test_model_checkpoint_mid_window_resumes_like_uninterrupted_run(
    cls, weights_only, tmp_path
):
    k, b = 4, 2
    x, y = regression_data(6, 2 * k * b)
    path = tmp_path / ("ckpt.weights.h5" if weights_only else "ckpt.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(
        path, save_weights_only=weights_only
    )
    uninterrupted, _ = fit_interrupted(
        lambda: _compiled(cls, k), x, y, 6 * b, b, callbacks=[checkpoint]
    )
    if weights_only:
        restored = _compiled(cls, k)
        restored.optimizer.build(restored.trainable_variables)
        restored.load_weights(path)
    else:
        restored = keras.saving.load_model(path)
    assert int(restored.optimizer.micro_steps) == 2
    fit_in_order(restored, x[6 * b :], y[6 * b :], batch_size=b)
    _assert_resumed_like_uninterrupted(restored, uninterrupted)


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("cls", list(PARENTS))
def test_tf_train_checkpoint_mid_window_resumes_like_uninterrupted_run(
    cls, tmp_path
):
    import tensorflow as tf

    k, b = 4, 2
    x, y = regression_data(8, 2 * k * b)
    uninterrupted, interrupted = fit_interrupted(
        lambda: _compiled(cls, k), x, y, 5 * b, b
    )
    saved = tf.train.Checkpoint(
        model=interrupted, optimizer=interrupted.optimizer
    ).save(str(tmp_path / "ckpt"))

    restored = _compiled(cls, k)
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        saved
    ).assert_consumed()
    assert int(restored.optimizer.micro_steps) == 1
    fit_in_order(restored, x[5 * b :], y[5 * b :], batch_size=b)
    _assert_resumed_like_uninterrupted(restored, uninterrupted)


@pytest.mark.backends("tensorflow")
def test_tf_train_checkpoint_of_another_configuration_is_reported(tmp_path):
    import tensorflow as tf

    x, y = regression_data(0, 8)
    saved_model = _compiled(AdamAccumulate, 4)
    saved_model.fit(x, y, batch_size=2, verbose=0)
    saved = tf.train.Checkpoint(optimizer=saved_model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    other = _compiled(AdamAccumulate, 1)
    other.optimizer.build(other.trainable_variables)
    status = tf.train.Checkpoint(optimizer=other.optimizer).restore(saved)
    with pytest.raises(AssertionError):
        status.assert_consumed()
