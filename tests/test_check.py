"""`check_exactness` and `python -m accum_optimizers.check`.

The check's oracle is the parent Keras optimizer on the big batch; these
tests give it models with and without each known cause, and compare what
it measures with the parent run here.
"""

import contextlib
import io
import os
import random
import re
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import regression_data
from helpers import run_worker
from helpers import sequence_data
from helpers import sequence_model
from helpers import small_model
from helpers import to_numpy
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import accum_optimizers
from accum_optimizers import AccumulationLogger
from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate
from accum_optimizers import check_exactness
from accum_optimizers import schedules
from accum_optimizers import weigh_micro_batches
from accum_optimizers.check import ExactnessReport
from accum_optimizers.check import VariableDrift
from accum_optimizers.check import __main__ as check_cli
from accum_optimizers.layers import with_accum_batch_norm

ROOT = Path(__file__).resolve().parent.parent


def _compiled(model, optimizer, loss="mse", **kwargs):
    # Eager steps: the diagnosis tests run a few micro-batches, where
    # tracing a train function would cost more than running it.
    kwargs.setdefault("run_eagerly", True)
    model.compile(optimizer=optimizer, loss=loss, **kwargs)
    return model


def _causes(report):
    return [cause.name for cause in report.causes]


def _model(seed, *middle):
    """Dense(6), the layers the functions `middle` make, Dense(2), all made
    after `keras.utils.set_random_seed(seed)`."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(6),
            *(make() for make in middle),
            keras.layers.Dense(2),
        ]
    )


def _bn_model(seed):
    return _model(seed, keras.layers.BatchNormalization)


def test_clean_model_drift_stays_within_the_floor_over_20_updates():
    x, y = regression_data(0, 20 * 4 * 8)
    model = small_model(0)
    model.compile(optimizer=AdamAccumulate(1e-2, accum_iters=4), loss="mse")
    report = check_exactness(model, x, y, batch_size=8, verbose=0)
    assert report.updates == 20
    assert len(report.drift) == len(report.floor) == 20
    assert report.exact, str(report)
    assert report.causes == []
    # The weights moved far beyond the drift: the comparison is not
    # vacuous.
    assert all(v.drift < 1e-3 * v.moved for v in report.table), str(report)


def test_drift_is_the_distance_to_the_parent_on_the_big_batch():
    k, b, updates = 2, 4, 3
    x, y = regression_data(1, k * b * updates + 5)
    model = _bn_model(1)
    _compiled(model, SGDAccumulate(0.1, momentum=0.9, accum_iters=k))
    report = check_exactness(
        model, x, y, batch_size=b, updates=updates, verbose=0
    )
    runs = []
    for optimizer, batch_size in (
        (keras.optimizers.SGD(0.1, momentum=0.9), k * b),
        (SGDAccumulate(0.1, momentum=0.9, accum_iters=k), b),
    ):
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        clone.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
        n = k * b * updates
        clone.fit(x[:n], y[:n], batch_size=batch_size, shuffle=False, verbose=0)
        runs.append(clone.get_weights())
    expected = max(float(np.max(np.abs(a - e))) for a, e in zip(*runs))
    np.testing.assert_allclose(report.drift[-1], expected, rtol=1e-5)
    assert not report.exact
    assert "batch_statistics" in _causes(report)


def test_clean_model_has_no_cause_and_batch_norm_has_its_remedy():
    x, y = regression_data(2, 16)
    clean = _compiled(small_model(2), AdamAccumulate(accum_iters=2))
    assert (
        _causes(
            check_exactness(clean, x, y, batch_size=4, updates=2, verbose=0)
        )
        == []
    )
    model = _compiled(_bn_model(2), AdamAccumulate(accum_iters=2))
    report = check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    (cause,) = report.causes
    assert cause.name == "batch_statistics"
    assert "with_accum_batch_norm" in cause.remedy
    assert "batch_normalization" in cause.where


@pytest.mark.parametrize("accumulating_layer", [False, True])
def test_moving_statistics_are_the_big_batchs_with_accum_batch_norm(
    accumulating_layer,
):
    x, y = regression_data(20, 16)
    model = _bn_model(20)
    if accumulating_layer:
        model = with_accum_batch_norm(model, accum_iters=2)
    _compiled(model, SGDAccumulate(0.1, accum_iters=2))
    # Within the first window the weights do not move: its pooled
    # statistics are the big batch's.
    report = check_exactness(model, x, y, batch_size=4, updates=1, verbose=0)
    moving = {
        v.path.rsplit("/", 1)[1]: v.exact
        for v in report.table
        if "moving_" in v.path
    }
    assert moving == {
        "moving_mean": accumulating_layer,
        "moving_variance": accumulating_layer,
    }
    (cause,) = report.causes
    assert cause.name == "batch_statistics"
    assert ("already" in cause.remedy) == accumulating_layer


def test_random_layers_are_named_and_compared_in_inference_mode():
    x, y = regression_data(3, 16)
    model = _model(
        3,
        lambda: keras.layers.Dropout(0.5),
        lambda: keras.layers.GaussianNoise(0.3),
    )
    _compiled(model, AdamAccumulate(accum_iters=2))
    report = check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert _causes(report) == ["random_layers"]
    assert "dropout" in report.causes[0].where
    assert "gaussian_noise" in report.causes[0].where
    # With the random layers quiet, the window is the big batch.
    assert report.exact, str(report)


def test_short_last_micro_batch_is_named_unless_weighed():
    x, y = regression_data(4, 18)  # 18 % 4 = 2
    model = _compiled(small_model(4), AdamAccumulate(accum_iters=2))
    flush = [FlushAccumulation()]
    report = check_exactness(
        model, x, y, batch_size=4, updates=2, callbacks=flush, verbose=0
    )
    assert _causes(report) == ["short_micro_batch"]
    weigh_micro_batches(model)
    report = check_exactness(
        model, x, y, batch_size=4, updates=2, callbacks=flush, verbose=0
    )
    assert _causes(report) == []


def test_partial_window_is_named_unless_flushed():
    x, y = regression_data(5, 20)  # 5 micro-batches, windows of 2
    model = _compiled(small_model(5), AdamAccumulate(accum_iters=2))
    report = check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert _causes(report) == ["partial_window"]
    assert "FlushAccumulation" in report.causes[0].remedy
    report = check_exactness(
        model,
        x,
        y,
        batch_size=4,
        updates=2,
        verbose=0,
        callbacks=[FlushAccumulation()],
    )
    assert _causes(report) == []


def test_sum_reduction_is_named_and_drifts():
    x, y = regression_data(6, 16)
    model = _compiled(
        small_model(6),
        SGDAccumulate(0.05, accum_iters=2),
        loss=keras.losses.MeanSquaredError(reduction="sum"),
    )
    report = check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert _causes(report) == ["loss_not_divided_by_count"]
    assert not report.exact


def test_masked_loss_is_named_and_drifts_until_weighed():
    tokens, labels = sequence_data(7, 16)
    model = _compiled(
        sequence_model(7),
        SGDAccumulate(0.5, accum_iters=2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    report = check_exactness(
        model, tokens, labels, batch_size=4, updates=2, verbose=0
    )
    assert _causes(report) == ["unweighed_loss_counts"]
    assert not report.exact
    weigh_micro_batches(model)
    report = check_exactness(
        model, tokens, labels, batch_size=4, updates=2, verbose=0
    )
    assert _causes(report) == []
    assert report.exact, str(report)


def test_several_losses_with_their_own_counts_are_named():
    x, y = regression_data(8, 16, out_dim=1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3)(inputs)
    outputs = [keras.layers.Dense(1)(hidden), keras.layers.Dense(1)(hidden)]
    model = keras.Model(inputs, outputs)
    weighted = "mean_with_sample_weight"
    _compiled(
        model,
        SGDAccumulate(0.1, accum_iters=2),
        loss=[keras.losses.MeanSquaredError(reduction=weighted)] * 2,
    )
    sample_weight = np.linspace(0.1, 2.0, 16).astype("float32")
    report = check_exactness(
        model,
        x,
        [y, y],
        sample_weight=sample_weight,
        batch_size=4,
        updates=2,
        verbose=0,
    )
    assert _causes(report) == ["loss_counts_per_output"]
    report = check_exactness(
        model, x, [y, y], batch_size=4, updates=2, verbose=0
    )
    assert _causes(report) == []


@pytest.mark.backends("tensorflow")
def test_sparse_embedding_gradients_are_named_for_adam_on_tensorflow():
    tokens, labels = sequence_data(9, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for optimizer, named in (
        (AdamAccumulate(accum_iters=2), True),
        (SGDAccumulate(accum_iters=2), False),
    ):
        model = _compiled(sequence_model(9), optimizer, loss=loss)
        weigh_micro_batches(model)
        report = check_exactness(
            model, tokens, labels, batch_size=4, updates=2, verbose=0
        )
        expected = ["sparse_embedding_gradients"] if named else []
        assert _causes(report) == expected, optimizer


def test_loss_scale_optimizer_is_named():
    x, y = regression_data(10, 16)
    wrapped = keras.optimizers.LossScaleOptimizer(AdamAccumulate(accum_iters=2))
    model = _compiled(small_model(10), wrapped)
    report = check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert _causes(report) == ["dynamic_loss_scale"]
    assert "a LossScaleOptimizer" in report.causes[0].where
    assert report.exact, str(report)


def test_mixed_float16_policy_is_named():
    x, y = regression_data(10, 16)
    keras.config.set_dtype_policy("mixed_float16")
    model = _compiled(small_model(10), AdamAccumulate(accum_iters=2))
    report = check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert _causes(report) == ["dynamic_loss_scale"]
    assert "mixed_float16" in report.causes[0].where


def test_logger_with_more_steps_per_execution_than_windows_is_named():
    x, y = regression_data(11, 16)
    logger = [AccumulationLogger(update_freq="batch")]
    for steps, named in ((3, True), (2, False)):
        model = _compiled(
            small_model(11),
            AdamAccumulate(accum_iters=2),
            steps_per_execution=steps,
        )
        report = check_exactness(
            model, x, y, batch_size=4, updates=2, callbacks=logger, verbose=0
        )
        expected = ["logger_steps_per_execution"] if named else []
        assert _causes(report) == expected, steps


def _gradients(model, x, y):
    """`(loss, gradients)` of `model` on a batch, on TensorFlow or torch."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)
    model.zero_grad()
    loss = model.compute_loss(x, y, model(x, training=True))
    loss.backward()
    return loss, [v.value.grad for v in model.trainable_variables]


def _step_model(passes_loss):
    """A Functional model whose own `train_step` hands the optimizer the
    loss, or not."""

    class Step(keras.Model):
        def train_step(self, data):
            x, y = data
            loss, grads = _gradients(self, x, y)
            extra = {"loss": loss} if passes_loss else {}
            self.optimizer.apply(grads, self.trainable_variables, **extra)
            return {"loss": loss}

    keras.utils.set_random_seed(12)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(keras.layers.Dense(3)(inputs))
    return Step(inputs, outputs)


@pytest.mark.backends("tensorflow", "torch")  # JAX's train_step is stateless
def test_train_step_without_loss_is_named():
    x, y = regression_data(12, 16)
    for passes_loss in (False, True):
        model = _step_model(passes_loss)
        _compiled(model, AdamAccumulate(accum_iters=2))
        report = check_exactness(
            model, x, y, batch_size=4, updates=2, verbose=0
        )
        expected = [] if passes_loss else ["train_step_without_loss"]
        assert _causes(report) == expected, passes_loss
        assert report.exact, str(report)


@pytest.mark.filterwarnings("ignore:Training ended with 1 micro-batches")
def test_model_optimizer_and_random_state_are_left_as_they_were():
    x, y = regression_data(13, 40)
    model = _model(
        13, lambda: keras.layers.Dropout(0.2), keras.layers.BatchNormalization
    )
    _compiled(model, AdamAccumulate(accum_iters=2))
    model.fit(x[:12], y[:12], batch_size=4, shuffle=False, verbose=0)
    optimizer = model.optimizer
    assert int(optimizer.micro_steps) == 1  # mid-window
    weights = model.get_weights()
    state = to_numpy(optimizer.variables)

    def draws():
        values = [
            to_numpy(keras.random.normal((3,))),
            np.random.rand(3),
            np.array([random.random()]),
        ]
        if keras.backend.backend() == "torch":
            import torch

            values.append(torch.rand(3).numpy())
        return values

    keras.utils.set_random_seed(99)
    expected = draws()
    keras.utils.set_random_seed(99)
    keras.random.normal((1,))  # the global seed generator exists
    keras.utils.set_random_seed(99)
    check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert model.optimizer is optimizer
    for a, e in zip(draws(), expected):
        np.testing.assert_array_equal(a, e)
    for a, e in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, e)
    for a, e in zip(to_numpy(optimizer.variables), state):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"updates": 0}, "updates=0"),
        ({"updates": 5}, "updates=5"),  # 5 * 2 * 4 samples > 16
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": 2.5}, "batch_size=2.5"),
        ({"optimizer": keras.optimizers.Adam()}, "optimizer=<keras"),
        (
            {"optimizer": AdamAccumulate(accum_iters={0: 1, 2: 2})},
            "accum_iters=",
        ),
        (
            {
                "optimizer": SGDAccumulate(
                    learning_rate=schedules.adascale(0.1, 4),
                    accum_iters=2,
                    measure_noise_scale=True,
                )
            },
            "learning_rate=adascale",
        ),
        (
            {
                "optimizer": AdamAccumulate(
                    learning_rate=schedules.sqrt_scaling(0.1, 4),
                    accum_iters=2,
                )
            },
            "learning_rate=sqrt_scaling",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_argument_and_value(kwargs, error):
    x, y = regression_data(14, 16)
    model = _compiled(small_model(14), AdamAccumulate(accum_iters=2))
    arguments = dict(batch_size=4, updates=2, verbose=0)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=error):
        check_exactness(model, x, y, **arguments)


def test_a_dataset_instead_of_arrays_is_refused_naming_x():
    x, y = regression_data(15, 16)
    model = _compiled(small_model(15), AdamAccumulate(accum_iters=2))
    with pytest.raises(ValueError, match="`x` must be arrays"):
        check_exactness(model, iter([(x, y)]), None, batch_size=4, verbose=0)


def test_a_lambda_loss_needs_no_deserialization():
    x, y = regression_data(19, 16)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    _compiled(
        model,
        SGDAccumulate(0.1, accum_iters=2),
        loss=lambda y, p: keras.ops.mean(keras.ops.square(y - p), axis=-1),
    )
    report = check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert report.exact, str(report)
    assert model.compiled


def test_uncompiled_model_is_refused():
    x, y = regression_data(15, 16)
    with pytest.raises(ValueError, match="must be compiled"):
        check_exactness(small_model(15), x, y, batch_size=4, verbose=0)


def test_report_prints_unless_verbose_0(capsys):
    x, y = regression_data(16, 16)
    model = _compiled(small_model(16), AdamAccumulate(accum_iters=2))
    check_exactness(model, x, y, batch_size=4, updates=2, verbose=0)
    assert capsys.readouterr().out == ""
    report = check_exactness(model, x, y, batch_size=4, updates=2)
    printed = capsys.readouterr().out
    assert printed == str(report) + "\n"
    assert "exact" in printed and "dense" in printed


def test_a_long_table_shows_the_variables_that_drift_most():
    table = [
        VariableDrift(f"v{i}", moved=1.0, drift=0.0, floor=0.0, tolerance=1.0)
        for i in range(20)
    ]
    table[15] = VariableDrift("v15", 1.0, drift=5.0, floor=0.0, tolerance=1.0)
    report = ExactnessReport(
        exact=False,
        optimizer="SGDAccumulate(accum_iters=2)",
        batch_size=4,
        accum_iters=2,
        updates=1,
        drift=[5.0],
        floor=[0.0],
        table=table,
        causes=[],
    )
    lines = report.lines(max_rows=3)
    assert lines[2].split()[0] == "v15" and lines[2].endswith("<- drifts")
    assert "  ... 17 more variables, 0 drifting" in lines


def _saved(tmp_path, model, x, y):
    model.save(tmp_path / "model.keras")
    arrays = {"x": x} if y is None else {"x": x, "y": y}
    np.savez(tmp_path / "data.npz", **arrays)
    return [str(tmp_path / "model.keras"), str(tmp_path / "data.npz")]


def test_command_line_checks_a_saved_model(tmp_path):
    x, y = regression_data(17, 16)
    model = small_model(17)
    model.compile(optimizer=AdamAccumulate(accum_iters=2), loss="mse")
    files = _saved(tmp_path, model, x, y)
    env = dict(
        os.environ,
        KERAS_BACKEND=keras.backend.backend(),
        PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    )
    arguments = ["--batch-size", "4", "--updates", "2"]
    completed = run_worker(
        ["-m", "accum_optimizers.check", *files, *arguments],
        env,
        cwd=tmp_path,
        timeout=300,
    )
    assert "exact: the drift is within the round-off floor" in (
        completed.stdout
    )
    assert accum_optimizers.__file__.startswith(str(ROOT))


def test_command_line_exits_2_without_y(tmp_path, capsys):
    x, _ = regression_data(18, 16)
    model = _compiled(small_model(18), AdamAccumulate(accum_iters=2))
    files = _saved(tmp_path, model, x, None)
    assert check_cli.main([*files, "--batch-size", "4"]) == 2
    assert "has no array 'y'" in capsys.readouterr().err


# What the command line is given, good: a saved compiled model and its data
# (16 samples of 4 features; 2 updates of 2 micro-batches of 4 use them all).
_GOOD = ["--batch-size", "4", "--updates", "2"]


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """A folder with saved models, good and bad, and good data."""
    folder = tmp_path_factory.mktemp("cli")
    x, y = regression_data(21, 16)
    np.savez(folder / "data.npz", x=x, y=y)
    for name, optimizer in (
        ("model", AdamAccumulate(accum_iters=2)),
        ("adam", keras.optimizers.Adam()),
        ("uncompiled", None),
    ):
        model = small_model(21)
        if optimizer is not None:
            model.compile(optimizer=optimizer, loss="mse")
        model.save(folder / f"{name}.keras")
    (folder / "folder.keras").mkdir()
    (folder / "text.npz").write_text("x,y\n1,2\n")
    np.save(folder / "array.npy", x)
    return folder


# The usage errors the command line is drawn with, one kind per test case.
_USAGE_ERRORS = [
    "missing model",
    "corrupt model",
    "folder model",
    "uncompiled",
    "not accumulating",
    "missing data",
    "corrupt data",
    "text data",
    "npy data",
    "x shape",
    "few samples",
    "y length",
    "sample_weight length",
    "batch size",
]


def _bad_arrays(draw, bad):
    """Data of 16 samples with what `bad` says wrong in it, drawn."""
    arrays = dict(zip("xy", regression_data(22, 16)))
    if bad == "x shape":
        features = draw(st.integers(1, 8).filter(lambda n: n != 4))
        arrays["x"] = np.zeros((16, features), "float32")
    elif bad == "few samples":
        samples = draw(st.integers(1, 15))
        arrays = {name: a[:samples] for name, a in arrays.items()}
    else:
        name = bad.split()[0]
        length = draw(st.integers(1, 40).filter(lambda n: n != 16))
        arrays[name] = np.ones(length, "float32")
    return arrays


def _bad_command_line(draw, folder, bad):
    """`(argv, fragment)`: a command line with what `bad` says wrong in it,
    drawn, and what its error line must name."""
    model, data = folder / "model.keras", folder / "data.npz"
    drawn = folder / f"drawn{draw(st.integers(0, 10**6))}"
    if bad == "corrupt model":
        model = drawn.with_suffix(".keras")
        model.write_bytes(draw(st.binary(max_size=64)))
    elif bad == "corrupt data":
        data = drawn.with_suffix(".npz")
        data.write_bytes(draw(st.binary(max_size=64)))
    elif bad in ("x shape", "few samples", "y length", "sample_weight length"):
        data = drawn.with_suffix(".npz")
        np.savez(data, **_bad_arrays(draw, bad))
    else:
        model = {
            "missing model": folder / "missing.keras",
            "folder model": folder / "folder.keras",
            "uncompiled": folder / "uncompiled.keras",
            "not accumulating": folder / "adam.keras",
        }.get(bad, model)
        data = {
            "missing data": folder / "missing.npz",
            "text data": folder / "text.npz",
            "npy data": folder / "array.npy",
        }.get(bad, data)
    options = list(_GOOD)
    if bad == "batch size":
        options[1] = draw(st.sampled_from(["0", "-3", "2.5", "four"]))
    fragment = {
        "uncompiled": "must be compiled",
        "not accumulating": "optimizer=<keras",
        "x shape": "x.shape=(16, ",
        "few samples": "len(x)=",
        "y length": "len(y)=",
        "sample_weight length": "len(sample_weight)=",
        "batch size": f"--batch-size: must be an integer >= 1. Received: "
        f"{options[1]!r}",
    }.get(bad, repr(str(model if "model" in bad else data)))
    return [str(model), str(data), *options], fragment


@pytest.mark.parametrize("bad", _USAGE_ERRORS)
@settings(max_examples=max(2, settings.default.max_examples // 6))
@given(st.data())
def test_command_line_exits_2_with_one_line_on_a_drawn_usage_error(
    cli_files, bad, data
):
    argv, fragment = _bad_command_line(data.draw, cli_files, bad)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        # Keras' warnings on loading are not the error line.
        warnings.simplefilter("ignore")
        try:
            status = check_cli.main(argv)
        except SystemExit as stop:  # argparse
            status = stop.code
    assert status == 2, err.getvalue()
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("python -m accum_optimizers.check: error: ")
    assert fragment in lines[0], (fragment, lines[0])


def test_command_line_exits_3_when_training_fails(
    cli_files, capsys, monkeypatch
):
    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")

    # Not a drift: a CI job must not read a crash as one.
    monkeypatch.setattr(check_cli, "check_exactness", fails)
    files = [str(cli_files / "model.keras"), str(cli_files / "data.npz")]
    assert check_cli.main([*files, *_GOOD]) == 3
    err = capsys.readouterr().err
    assert "RuntimeError: out of memory" in err
    assert err.endswith("error: the check failed in training\n")


def test_command_line_exits_1_on_drift(tmp_path, capsys):
    x, y = regression_data(18, 16)
    model = _bn_model(18)
    model.compile(optimizer=AdamAccumulate(accum_iters=2), loss="mse")
    files = _saved(tmp_path, model, x, y)
    assert check_cli.main([*files, "--batch-size", "4", "--updates", "2"]) == 1
    assert "cause: batch_statistics" in capsys.readouterr().out


@pytest.mark.backends("jax")  # The page shows JAX's output.
def test_docs_page_shows_what_the_clean_example_prints():
    page = (ROOT / "docs" / "check.md").read_text()
    code, shown = re.search(
        r'```python title="check a clean model"\n(.*?)```.*?'
        r"```text\n(.*?)```",
        page,
        re.S,
    ).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "check.md", "exec"), {})
    assert out.getvalue() == shown
