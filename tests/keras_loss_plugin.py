"""A pytest plugin for Keras' own tests of its losses
(`tests/test_no_patch.py` runs them with it): each test runs inside
`recorded_loss_reductions`, so that they check that the wrapper of Keras'
`reduce_weighted_values` passes every call through as Keras' own. Reports
the count of reductions recorded."""

import os

import pytest

from accum_optimizers import _keras_private

_recorded = []


@pytest.fixture(autouse=True)
def _recording():
    with _keras_private.recorded_loss_reductions() as records:
        yield
    _recorded.extend(records)


def pytest_unconfigure(config):
    with open(os.environ["RECORDED_REDUCTIONS_FILE"], "w") as file:
        file.write(str(len(_recorded)))
