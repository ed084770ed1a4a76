"""The noise scale under `tf.distribute`: refused with more than one
replica, naming the argument and the replica count
(noise_mirrored_worker.py, a `MirroredStrategy` over 2 CPU devices).

(keras.distribution: test_distribution_jax.py; torch `sync_windows`:
test_distribution_torch.py.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.backends("tensorflow")
def test_tf_distribute_with_several_replicas_is_refused_by_name(tmp_path):
    here = Path(__file__).resolve().parent
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, str(here / "noise_mirrored_worker.py"), str(out)],
        cwd=here,
        env=dict(
            os.environ,
            TF_CPP_MIN_LOG_LEVEL="3",
            KERAS_BACKEND="tensorflow",
            PYTHONPATH=os.pathsep.join(
                [str(here.parent), os.environ.get("PYTHONPATH", "")]
            ),
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["replicas"] == 2
    assert "measure_noise_scale=True" in results["error"]
    assert "num_replicas_in_sync=2" in results["error"]
