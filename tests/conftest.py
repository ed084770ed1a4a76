import gc
import os

import keras
import pytest
from hypothesis import HealthCheck
from hypothesis import settings

# What every profile shares: no deadline, the failing example's blob
# printed, slow examples allowed.
PROFILE = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# CI: few, deterministic examples. Locally: HYPOTHESIS_PROFILE=thorough.
settings.register_profile("ci", max_examples=12, derandomize=True, **PROFILE)
# The compatibility legs (scripts/run_compat.py): the suite's core on other
# Keras versions, in a few minutes each.
settings.register_profile("compat", max_examples=4, derandomize=True, **PROFILE)
settings.register_profile("thorough", max_examples=200, **PROFILE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_report_header(config):
    return f"keras backend: {keras.backend.backend()}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "backends(*names): run only on these Keras backends"
    )
    # The backend's modules, alive for the whole run, out of the cyclic
    # collector's reach: each full collection would walk them again, which
    # grows to seconds a collection as the tests' own objects pile up.
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    backend = keras.backend.backend()
    for item in items:
        marker = item.get_closest_marker("backends")
        if marker is not None and backend not in marker.args:
            item.add_marker(
                pytest.mark.skip(reason=f"not applicable on {backend}")
            )


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    # Keras' global state only: a forced full garbage collection before
    # every test walks the whole heap of the backend's modules, and Python's
    # own collector frees the cycles anyway.
    keras.backend.clear_session(free_memory=False)
    yield
    keras.config.set_dtype_policy("float32")
