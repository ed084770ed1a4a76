"""A pytest plugin for Keras' own tests of its optimizer wrappers
(`tests/test_no_patch.py` runs them with it): every `LossScaleOptimizer` and
`MultiOptimizer` they make cooperates as one that met an accumulating
optimizer does (`_wrappers.cooperate`), so that they check that its methods
pass everything else through as Keras' own. Reports the count made."""

import os

from accum_optimizers import _keras_private
from accum_optimizers import _wrappers

_made = []


def _cooperating(init):
    def init_then_cooperate(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _wrappers.cooperate(self)
        _made.append(type(self).__name__)

    return init_then_cooperate


def pytest_configure(config):
    # This test process only: the package itself patches nothing.
    for cls in _keras_private.wrapper_optimizer_classes():
        cls.__init__ = _cooperating(cls.__init__)


def pytest_unconfigure(config):
    with open(os.environ["COOPERATING_WRAPPERS_FILE"], "w") as file:
        file.write("\n".join(_made))
