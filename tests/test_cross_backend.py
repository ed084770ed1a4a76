"""A `.keras` file saved mid-window on one backend resumes on another.

Each pair runs in the test process of its source backend, which saves in
process; the target resumes in a subprocess (Keras holds one backend per
process). The three pairs close a cycle over the backends, one pair per
test process.
"""

import importlib.util
import os

import keras
import numpy as np
import pytest
from helpers import TESTS
from helpers import run_worker

PAIRS = [("tensorflow", "jax"), ("jax", "torch"), ("torch", "tensorflow")]


def _resume_in_subprocess(backend, directory):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"backend {backend} is not installed")
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    run_worker(
        [TESTS / "cross_backend_worker.py", "resume", directory],
        env,
        timeout=300,
    )


@pytest.mark.parametrize(
    "source, target",
    [
        pytest.param(
            source,
            target,
            marks=pytest.mark.backends(source),
            id=f"{source}-{target}",
        )
        for source, target in PAIRS
    ],
)
def test_saved_mid_window_on_one_backend_resumes_on_another(
    source, target, tmp_path
):
    import cross_backend_worker

    assert keras.backend.backend() == source
    cross_backend_worker.save(tmp_path)
    _resume_in_subprocess(target, tmp_path)
    result = np.load(tmp_path / "result.npz")
    assert int(result["iterations"]) == 2
    np.testing.assert_allclose(
        result["resumed"], result["uninterrupted"], rtol=1e-5, atol=1e-6
    )
