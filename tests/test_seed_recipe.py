"""The worked example of the TF1 accumulate-then-apply recipe (compute the
gradients of several small batches, average them, apply the average once;
`docs/migrate/tf1-accumulate-ops.md`): a 3x3 `W`, three batches of one row
each, loss = mean(x @ W), plain gradient descent at learning rate 0.1.

By hand: for a batch of N rows, d mean(x @ W) / dW[i, j] = mean_n(x[n, i]) / 3.
The three rows average to [14, 15, 16], so one step on the three-row batch
subtracts 0.1 * [14, 15, 16] / 3 from the rows of W. The tests check that
three accumulated one-row micro-batches give exactly that one step.
"""

import keras
import numpy as np
from keras import ops

from accum_optimizers import SGDAccumulate

W = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype="float32")
X = np.array([[11, 12, 13], [14, 15, 16], [17, 18, 19]], dtype="float32")
ONE_STEP_ON_THREE_ROWS = np.array(
    [
        [1 - 1.4 / 3, 2 - 1.4 / 3, 3 - 1.4 / 3],
        [4 - 0.5, 5 - 0.5, 6 - 0.5],
        [7 - 1.6 / 3, 8 - 1.6 / 3, 9 - 1.6 / 3],
    ],
    dtype="float32",
)


def test_apply_gradients_of_three_rows_gives_one_step_on_the_batch():
    w = keras.Variable(W)
    optimizer = SGDAccumulate(learning_rate=0.1, accum_iters=3)
    for row in X:
        # d mean(row @ W) / dW[i, j] = row[i] / 3, computed by hand.
        grad = ops.convert_to_tensor(np.repeat(row[:, None] / 3.0, 3, axis=1))
        optimizer.apply_gradients([(grad, w)])
    np.testing.assert_allclose(
        ops.convert_to_numpy(w.value), ONE_STEP_ON_THREE_ROWS, rtol=1e-6
    )
    assert int(optimizer.iterations) == 1


def test_model_fit_with_batch_one_gives_one_step_on_the_batch():
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(3, use_bias=False)]
    )
    model.set_weights([W])
    model.compile(
        optimizer=SGDAccumulate(learning_rate=0.1, accum_iters=3),
        loss=lambda y_true, y_pred: ops.mean(y_pred),
    )
    model.fit(X, np.zeros_like(X), batch_size=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        model.get_weights()[0], ONE_STEP_ON_THREE_ROWS, rtol=1e-6
    )
