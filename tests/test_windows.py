"""Partial windows (`flush`, `FlushAccumulation`), introspection, and Keras'
learning-rate callbacks, against the parent optimizer on the same groupings."""

import warnings

import keras
import numpy as np
import pytest
from helpers import PARENTS
from helpers import assert_same_weights
from helpers import fit_in_order
from helpers import regression_data
from helpers import small_model
from loops import gradients

from accum_optimizers import AdamAccumulate
from accum_optimizers import FlushAccumulation
from accum_optimizers import SGDAccumulate

K, B = 4, 2


@pytest.mark.parametrize("cls", list(PARENTS))
def test_flush_every_epoch_gives_windows_of_4_4_2(cls):
    x, y = regression_data(1, 10 * B)  # 10 micro-batches per epoch
    big = small_model(1)
    big.compile(optimizer=PARENTS[cls](), loss="mse")
    # The parent's batches of 4*B over 10*B samples: 4*B, 4*B, 2*B.
    fit_in_order(big, x, y, batch_size=K * B, epochs=3)

    ours = small_model(1)
    ours.compile(optimizer=cls(accum_iters=K), loss="mse")
    fit_in_order(ours, x, y, batch_size=B, epochs=3, flush=True)
    assert int(ours.optimizer.iterations) == 9
    assert int(ours.optimizer.micro_steps) == 0
    assert_same_weights(ours, big)


def test_without_flush_the_partial_window_carries_into_the_next_epoch():
    x, y = regression_data(1, 10 * B)
    ours = small_model(1)
    ours.compile(optimizer=SGDAccumulate(accum_iters=K), loss="mse")
    fit_in_order(ours, x, y, batch_size=B, epochs=2)
    assert int(ours.optimizer.iterations) == 5  # 20 micro-batches / 4
    assert int(ours.optimizer.micro_batches_seen) == 20


def test_flush_only_at_train_end():
    x, y = regression_data(2, 10 * B)
    ours = small_model(2)
    ours.compile(optimizer=SGDAccumulate(0.1, accum_iters=K), loss="mse")
    fit_in_order(
        ours,
        x,
        y,
        batch_size=B,
        epochs=2,
        callbacks=[FlushAccumulation(every_epoch=False)],
    )
    # 20 micro-batches: 5 full windows, nothing pending, nothing flushed.
    assert int(ours.optimizer.iterations) == 5
    fit_in_order(
        ours,
        x[: 6 * B],
        y[: 6 * B],
        batch_size=B,
        callbacks=[FlushAccumulation(every_epoch=False)],
    )
    # 6 more: one full window, then 2 flushed at the end of training.
    assert int(ours.optimizer.iterations) == 7
    assert int(ours.optimizer.micro_steps) == 0


def test_flush_applies_the_mean_of_the_held_micro_batches():
    x, y = regression_data(3, 3 * B)
    parent_model, our_model = small_model(3), small_model(3)
    parent = keras.optimizers.Adam(0.01)
    ours = AdamAccumulate(0.01, accum_iters=K)
    parent.apply(
        gradients(parent_model, x, y), parent_model.trainable_variables
    )
    for i in range(3):
        batch = slice(i * B, (i + 1) * B)
        ours.apply(
            gradients(our_model, x[batch], y[batch]),
            our_model.trainable_variables,
        )
    assert int(ours.iterations) == 0 and int(ours.micro_steps) == 3
    assert not bool(ours.last_apply_updated)
    ours.flush()
    assert int(ours.iterations) == 1 and int(ours.micro_steps) == 0
    assert bool(ours.last_apply_updated)
    assert_same_weights(our_model, parent_model)


def test_flush_with_nothing_pending_does_nothing():
    model = small_model(0)
    optimizer = SGDAccumulate(accum_iters=2)
    optimizer.flush()  # not built yet
    optimizer.build(model.trainable_variables)
    before = model.get_weights()
    optimizer.flush()
    assert int(optimizer.iterations) == 0
    for now, then in zip(model.get_weights(), before):
        np.testing.assert_array_equal(now, then)


def test_introspection_counts_updates_micro_steps_and_micro_batches():
    model = small_model(0)
    x, y = regression_data(0, 7)
    optimizer = SGDAccumulate(accum_iters=3)
    seen = []
    for i in range(7):
        optimizer.apply(
            gradients(model, x[i : i + 1], y[i : i + 1]),
            model.trainable_variables,
        )
        seen.append(
            (
                int(optimizer.iterations),
                int(optimizer.micro_steps),
                int(optimizer.micro_batches_seen),
                bool(optimizer.last_apply_updated),
            )
        )
    assert seen == [
        (0, 1, 1, False),
        (0, 2, 2, False),
        (1, 0, 3, True),
        (1, 1, 4, False),
        (1, 2, 5, False),
        (2, 0, 6, True),
        (2, 1, 7, False),
    ]


def test_introspection_with_accum_iters_1_is_the_parent_count():
    model = small_model(0)
    x, y = regression_data(0, 2)
    optimizer = SGDAccumulate(accum_iters=1)
    optimizer.apply(gradients(model, x, y), model.trainable_variables)
    assert int(optimizer.micro_steps) == 0
    assert int(optimizer.micro_batches_seen) == 1
    assert bool(optimizer.last_apply_updated)


def test_flush_callback_refuses_a_non_accumulating_optimizer():
    x, y = regression_data(0, 4)
    model = small_model(0)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="accumulating optimizer"):
        model.fit(x, y, verbose=0, callbacks=[FlushAccumulation()])


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_flush_callback_validates_its_arguments(bad):
    with pytest.raises(TypeError, match=f"every_epoch={bad!r}"):
        FlushAccumulation(every_epoch=bad)


@pytest.mark.parametrize(
    "callback",
    [
        lambda: keras.callbacks.LearningRateScheduler(
            lambda epoch: 0.1 * 0.5**epoch
        ),
        lambda: keras.callbacks.ReduceLROnPlateau(
            monitor="loss", factor=0.5, patience=0, min_delta=10.0
        ),
    ],
    ids=["LearningRateScheduler", "ReduceLROnPlateau"],
)
def test_keras_learning_rate_callbacks_keep_working(callback):
    x, y = regression_data(4, 3 * K * B)
    big = small_model(4)
    big.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    fit_in_order(big, x, y, batch_size=K * B, epochs=3, callbacks=[callback()])
    ours = small_model(4)
    ours.compile(
        optimizer=SGDAccumulate(0.1, momentum=0.5, accum_iters=K), loss="mse"
    )
    fit_in_order(ours, x, y, batch_size=B, epochs=3, callbacks=[callback()])
    np.testing.assert_allclose(
        float(keras.ops.convert_to_numpy(ours.optimizer.learning_rate)),
        0.025,
        rtol=1e-6,
    )
    assert_same_weights(ours, big)


def test_a_fit_that_ends_with_a_pending_window_says_so_once():
    x, y = regression_data(3, 7 * B)  # 7 micro-batches: 3 pending
    model = small_model(3)
    model.compile(optimizer=SGDAccumulate(accum_iters=K), loss="mse")
    with pytest.warns(UserWarning, match="3 micro-batches") as record:
        fit_in_order(model, x, y, batch_size=B)
    pending = [w for w in record if "pending" in str(w.message)]
    assert len(pending) == 1
    assert "FlushAccumulation" in str(pending[0].message)


def test_flush_at_train_end_stands_while_flush_accumulation_trains():
    x, y = regression_data(3, 7 * B)  # 7 micro-batches: 3 pending
    model = small_model(3)
    optimizer = SGDAccumulate(accum_iters=K)
    model.compile(optimizer=optimizer, loss="mse")
    seen = []
    watch = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(
            optimizer.flush_at_train_end
        )
    )
    model.fit(
        x,
        y,
        batch_size=B,
        shuffle=False,
        verbose=0,
        callbacks=[FlushAccumulation(), watch],
    )
    assert seen == [True] * 7
    assert optimizer.flush_at_train_end is False
    # Set by hand (a loop that flushes after `fit` on its own): `fit`
    # leaves the pending window to it, without a warning.
    optimizer.flush_at_train_end = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(keras.ops.convert_to_numpy(optimizer.micro_steps)) == 3


def test_a_fit_that_raises_leaves_flush_at_train_end_unset():
    # TensorFlow and torch call no `on_train_end` for a `fit` that raises
    # (JAX's `finally` ends it through `finalize_variable_values`).
    x, y = regression_data(3, 7 * B)
    model = small_model(3)
    optimizer = SGDAccumulate(accum_iters=K)
    model.compile(optimizer=optimizer, loss="mse")

    def fail(batch, logs):
        if batch == 1:  # mid-window, mid-epoch
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        model.fit(
            x,
            y,
            batch_size=B,
            shuffle=False,
            verbose=0,
            callbacks=[
                FlushAccumulation(),
                keras.callbacks.LambdaCallback(on_train_batch_end=fail),
            ],
        )
    assert optimizer.flush_at_train_end is False
    # A training end of one's own (a custom loop) warns of the window the
    # failed `fit` left pending: nothing flushes it.
    with pytest.warns(UserWarning, match="2 micro-batches"):
        optimizer.finalize_variable_values(model.trainable_variables)


@pytest.mark.parametrize("samples, callbacks", [(8 * B, []), (7 * B, None)])
def test_no_pending_window_warning_when_nothing_is_left(samples, callbacks):
    x, y = regression_data(3, samples)
    model = small_model(3)
    model.compile(optimizer=SGDAccumulate(accum_iters=K), loss="mse")
    if callbacks is None:
        callbacks = [FlushAccumulation()]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fit_in_order(model, x, y, batch_size=B, callbacks=callbacks)
