"""Worker for test_cross_backend.py: one backend per process.

    KERAS_BACKEND=tensorflow python cross_backend_worker.py save DIR
    KERAS_BACKEND=jax python cross_backend_worker.py resume DIR

The test calls `save` in its own process and runs `resume` as above.

`save` trains 6 of 8 micro-batches (one window of 4 applied, 2 pending) and
saves `DIR/model.keras` plus the initial weights. `resume` loads the model on
its own backend, trains the last 2 micro-batches, and writes the resumed
weights and those of an uninterrupted run from the same initial weights, on
the same backend, to `DIR/result.npz`.
"""

import sys
from pathlib import Path

import keras
import numpy as np
from helpers import regression_data
from helpers import small_model

from accum_optimizers import AdamAccumulate

K, B = 4, 2


def _optimizer():
    return AdamAccumulate(0.01, amsgrad=True, accum_iters=K)


def save(directory):
    x, y = regression_data(21, 2 * K * B)
    model = small_model(21)
    np.savez(directory / "initial.npz", *model.get_weights())
    model.compile(optimizer=_optimizer(), loss="mse")
    model.fit(x[: 6 * B], y[: 6 * B], batch_size=B, shuffle=False, verbose=0)
    assert int(model.optimizer.micro_steps) == 2
    model.save(directory / "model.keras")


def resume(directory):
    x, y = regression_data(21, 2 * K * B)
    restored = keras.saving.load_model(directory / "model.keras")
    assert int(restored.optimizer.micro_steps) == 2
    if keras.backend.backend() == "torch":
        # The file keeps the `jit_compile` its source resolved "auto" to,
        # True from JAX, which torch runs as `torch.compile`: its tracing
        # would be most of this test's time, and `test_execution_modes`
        # covers it. The uninterrupted run below takes torch's default.
        restored.jit_compile = False
    restored.fit(x[6 * B :], y[6 * B :], batch_size=B, shuffle=False, verbose=0)

    initial = np.load(directory / "initial.npz")
    uninterrupted = small_model(21)
    uninterrupted.set_weights(
        [initial[f"arr_{i}"] for i in range(len(initial))]
    )
    uninterrupted.compile(optimizer=_optimizer(), loss="mse")
    uninterrupted.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    np.savez(
        directory / "result.npz",
        resumed=np.concatenate([w.ravel() for w in restored.get_weights()]),
        uninterrupted=np.concatenate(
            [w.ravel() for w in uninterrupted.get_weights()]
        ),
        iterations=int(restored.optimizer.iterations),
    )


if __name__ == "__main__":
    {"save": save, "resume": resume}[sys.argv[1]](Path(sys.argv[2]))
