"""Wrote this backend's saved states, mid-window, into `<backend>/`, once,
with the code before the window-record rewrite (see README.md): the files are
frozen, and `tests/test_saved_states.py` loads them with the code of now.
Kept as the record of how they were written, not to be run again: run by
later code, it would write that code's states, which is not their point (it
refuses a backend whose folder exists).

For each configuration (`CONFIGS`): `<name>.keras` (`model.save`),
`<name>.weights.h5` (`model.save_weights`, which in Keras 3 holds the
compiled optimizer's variables too), on TensorFlow `<name>_ckpt.*`
(`tf.train.Checkpoint(model=, optimizer=).write`), and `<name>.npz`: the
optimizer's variables (`opt_<i>`, in `optimizer.variables` order) and the
model's weights (`model_<i>`) at save time, the initial weights
(`initial_<i>`), the micro-batches that finish the pending window
(`finish_*`), and what the oracle replays (`fit`: the data; `loop`: every
micro-step's gradients, weights, losses and whether it was skipped). It
was run as `KERAS_BACKEND=<backend> python tests/data/saved_states/make.py`.
"""

import sys
import warnings
from pathlib import Path

import keras
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for helpers

from helpers import fit_in_order  # noqa: E402
from helpers import regression_data  # noqa: E402
from helpers import small_model  # noqa: E402
from helpers import small_model_gradients  # noqa: E402
from helpers import to_numpy  # noqa: E402

from accum_optimizers import AdamAccumulate  # noqa: E402

LEARNING_RATE = 0.05
FIT_ACCUM_ITERS, FIT_BATCH = 3, 2
LOOP_ACCUM_ITERS = 4
# The loop's micro-steps, in order: the variables left out (`None`), and
# whether its gradients are non-finite (skipped). Window 1 leaves variable 2
# out of one micro-step and holds the skipped one; window 2 is plain; the
# pending window 3 never reaches variable 1 and reaches variable 3 in its
# first micro-step only, so that its seen-mask decides what it updates.
LOOP_STEPS = [
    ((), False),
    ((2,), False),
    ((), True),
    ((), False),
    ((), False),
    ((), False),
    ((), False),
    ((), False),
    ((), False),
    ((1,), False),  # saved: the pending window's 2 micro-steps
    ((1, 3), False),
    ((1, 3), False),  # the 2 that finish it, after loading
    ((1, 3), False),
]
LOOP_SAVED = 11  # micro-steps taken before saving


def fit_optimizer():
    return AdamAccumulate(LEARNING_RATE, accum_iters=FIT_ACCUM_ITERS)


def loop_optimizer():
    return AdamAccumulate(
        LEARNING_RATE,
        accum_iters=LOOP_ACCUM_ITERS,
        measure_noise_scale=True,
        skip_nonfinite=True,
    )


def compiled(make_optimizer, seed=0):
    model = small_model(seed)
    model.compile(optimizer=make_optimizer(), loss="mse")
    return model


def _state(model):
    arrays = {}
    for i, value in enumerate(to_numpy(model.optimizer.variables)):
        arrays[f"opt_{i}"] = value
    for i, value in enumerate(model.get_weights()):
        arrays[f"model_{i}"] = value
    return arrays


def write_fit(out):
    """`fit` on 8 micro-batches of 2: 2 windows of 3, then 2 pending; the
    9th micro-batch (the data's last 2 samples) finishes the window."""
    b, k = FIT_BATCH, FIT_ACCUM_ITERS
    x, y = regression_data(11, 3 * k * b)
    model = compiled(fit_optimizer)
    initial = model.get_weights()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pending window at fit's end
        fit_in_order(model, x[: 8 * b], y[: 8 * b], batch_size=b)
    assert int(model.optimizer.iterations) == 2
    assert int(model.optimizer.micro_steps) == 2
    # The 9th micro-batch's mean loss and its gradient, at the weights the
    # window computes its gradients at (they do not move mid-window).
    xb, yb = x[8 * b :], y[8 * b :]
    weights = model.get_weights()
    grads = small_model_gradients(weights, xb, yb, np.full(b, 1.0 / b))
    prediction = np.tanh(xb @ weights[0] + weights[1]) @ weights[2]
    loss = np.mean((prediction + weights[3] - yb) ** 2)
    arrays = _state(model)
    arrays.update({f"initial_{i}": w for i, w in enumerate(initial)})
    arrays.update(
        {f"finish_grad_0_{i}": g.astype("float32") for i, g in enumerate(grads)}
    )
    arrays.update(
        finish_weight=np.array([np.nan], "float32"),
        finish_loss=np.array([loss], "float32"),
        x=x,
        y=y,
        batch_size=np.array(b),
    )
    _save(model, out / "fit", arrays)


def write_loop(out):
    """`apply(grads, weight=, loss=)` on drawn gradients (`LOOP_STEPS`)."""
    rng = np.random.default_rng(12)
    model = compiled(loop_optimizer)
    optimizer = model.optimizer
    variables = model.trainable_variables
    optimizer.build(variables)
    initial = model.get_weights()
    steps = []
    for missing, nonfinite in LOOP_STEPS:
        grads = [
            None
            if i in missing
            else rng.normal(size=tuple(v.shape)).astype("float32")
            for i, v in enumerate(variables)
        ]
        if nonfinite:
            grads[0][0, 0] = np.inf
        weight = float(rng.choice([0.5, 1.0, 2.0, 3.0]))
        loss = float(rng.uniform(0.5, 2.0))
        steps.append((grads, weight, loss, nonfinite))
    for grads, weight, loss, _ in steps[:LOOP_SAVED]:
        optimizer.apply(grads, variables, weight=weight, loss=loss)
    assert int(optimizer.iterations) == 2
    assert int(optimizer.micro_steps) == 2
    assert int(optimizer.skipped_micro_batches) == 1
    arrays = _state(model)
    arrays.update({f"initial_{i}": w for i, w in enumerate(initial)})
    for n, (grads, _, _, _) in enumerate(steps):
        arrays.update(
            {
                f"step_grad_{n}_{i}": g
                for i, g in enumerate(grads)
                if g is not None
            }
        )
    arrays.update(
        step_weight=np.array([s[1] for s in steps], "float32"),
        step_loss=np.array([s[2] for s in steps], "float32"),
        step_skipped=np.array([s[3] for s in steps]),
    )
    for n, (grads, *_) in enumerate(steps[LOOP_SAVED:]):
        arrays.update(
            {
                f"finish_grad_{n}_{i}": g
                for i, g in enumerate(grads)
                if g is not None
            }
        )
    finishing = steps[LOOP_SAVED:]
    arrays.update(
        finish_weight=np.array([s[1] for s in finishing], "float32"),
        finish_loss=np.array([s[2] for s in finishing], "float32"),
    )
    _save(model, out / "loop", arrays)


def _save(model, stem, arrays):
    model.save(f"{stem}.keras")
    model.save_weights(f"{stem}.weights.h5")
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
            f"{stem}_ckpt"
        )
    np.savez_compressed(f"{stem}.npz", **arrays)


def main():
    out = HERE / keras.backend.backend()
    out.mkdir()  # never over frozen files
    write_fit(out)
    keras.backend.clear_session()
    write_loop(out)


if __name__ == "__main__":
    main()
