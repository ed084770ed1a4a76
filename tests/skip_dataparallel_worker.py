"""Worker for test_skip_distributed.py: `skip_nonfinite` data-parallel.

    KERAS_BACKEND=jax python skip_dataparallel_worker.py OUT.json

Fits `skip_case` under `keras.distribution.DataParallel` over the 2 JAX
CPU devices `run_jax_worker` gives it; writes what it measured to
OUT.json, as JSON.
"""

import contextlib
import json
import sys
from pathlib import Path

import jax
import keras
import skip_case


def main(out):
    devices = jax.devices()
    assert len(devices) == 2, devices
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices)
    )
    result = skip_case.fit(contextlib.nullcontext)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
