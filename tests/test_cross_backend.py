"""A `.keras` file saved mid-window on one backend resumes on another.

Runs once, from the TensorFlow test process; each side runs in its own
subprocess (Keras holds one backend per process).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent


def _run(backend, action, directory):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"backend {backend} is not installed")
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [
            sys.executable,
            str(HERE / "cross_backend_worker.py"),
            action,
            str(directory),
        ],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize(
    "source, target",
    [("tensorflow", "jax"), ("jax", "torch"), ("torch", "tensorflow")],
    ids=lambda name: name,
)
def test_saved_mid_window_on_one_backend_resumes_on_another(
    source, target, tmp_path
):
    _run(source, "save", tmp_path)
    _run(target, "resume", tmp_path)
    result = np.load(tmp_path / "result.npz")
    assert int(result["iterations"]) == 2
    np.testing.assert_allclose(
        result["resumed"], result["uninterrupted"], rtol=1e-5, atol=1e-6
    )
