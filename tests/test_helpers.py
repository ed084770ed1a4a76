"""The shared test toolkit fails where it should: a comparison that passes
with an item missing, or an oracle off by a weight, would hide bugs."""

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import parent_on_window_means
from helpers import to_numpy


def test_assert_all_close_refuses_lists_of_different_lengths():
    with pytest.raises(AssertionError, match="2 weights, expected 3"):
        assert_all_close(
            [np.zeros(1)] * 2, [np.zeros(1)] * 3, rtol=0, atol=0, what="weight"
        )


def test_assert_all_close_names_the_item_that_differs():
    with pytest.raises(AssertionError, match="statistic b differs"):
        assert_all_close(
            {"a": 1.0, "b": 2.0},
            {"a": 1.0, "b": 3.0},
            rtol=0,
            atol=0,
            what="statistic",
        )
    with pytest.raises(AssertionError):
        assert_all_close({"a": 1.0}, {"a": 1.0, "b": 3.0}, rtol=0, atol=0)


@pytest.mark.parametrize("updated", ["any", [0]])
def test_parent_on_window_means_is_sgd_on_the_weighted_mean(updated):
    variables = [keras.Variable(np.zeros(2)), keras.Variable(np.zeros(1))]
    window = [
        [np.array([1.0, 2.0], "float32"), np.array([4.0], "float32")],
        [np.array([3.0, 6.0], "float32"), None],
    ]
    sgd = keras.optimizers.SGD(learning_rate=1.0)
    parent_on_window_means(sgd, variables, [window], [[1.0, 3.0]], updated)
    # By hand: (1 * [1, 2] + 3 * [3, 6]) / 4 = [2.5, 5]; (1 * 4 + 3 * 0) / 4
    # = 1 for the second variable, which "any" updates and [0] leaves.
    np.testing.assert_allclose(to_numpy(variables[0]), [-2.5, -5.0])
    second = [-1.0] if updated == "any" else [0.0]
    np.testing.assert_allclose(to_numpy(variables[1]), second)
