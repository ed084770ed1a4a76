"""Worker for test_multiworker_tf.py: one `MultiWorkerMirroredStrategy` task.

    TF_CONFIG=... KERAS_BACKEND=tensorflow python multiworker_worker.py OUT

Each of the 2 processes holds one replica. Together they train a small
model with `accum_iters=K` on a global micro-batch of `2 * B`, in a custom
loop (Keras 3's `model.fit` fails under this strategy for every optimizer,
keras-team/keras#20585):

- `fit`: the whole data;
- `resume`: a fresh model trains one window and 2 micro-batches, every task
  writes a `tf.train.Checkpoint` of the model and the optimizer (so the
  pending window too), a second fresh model and optimizer read the chief's,
  and train the rest.

The chief writes both end states to `OUT/weights.npz`, with the micro-steps
pending at the save; the test compares them with the parent optimizer on
one process with the global batch.
"""

import json
import os
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from helpers import regression_data
from helpers import small_model
from helpers import train_with_strategy

from accum_optimizers import AdamAccumulate

K, B, WORKERS = 3, 4, 2
GLOBAL_MICRO = B * WORKERS
N = 2 * K * GLOBAL_MICRO
SPLIT = K * GLOBAL_MICRO + 2 * GLOBAL_MICRO  # one window + 2 pending


def fresh_model(strategy):
    with strategy.scope():
        model = small_model(0)
        optimizer = AdamAccumulate(
            0.01, accum_iters=K, global_clipnorm=0.5, amsgrad=True
        )
        optimizer.build(model.trainable_variables)
    return model, optimizer


def train(strategy, model, optimizer, x, y):
    """A custom loop; each task feeds its slice of every global batch."""

    def dataset(context):
        lo = context.input_pipeline_id * B
        return (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(GLOBAL_MICRO)
            .map(lambda xb, yb: (xb[lo : lo + B], yb[lo : lo + B]))
        )

    train_with_strategy(
        strategy,
        model,
        optimizer,
        strategy.distribute_datasets_from_function(dataset),
        GLOBAL_MICRO,
    )


def barrier(strategy):
    """Returns once every task has reached it (an all-reduce)."""
    strategy.reduce(
        tf.distribute.ReduceOp.SUM,
        strategy.run(lambda: tf.constant(1.0)),
        axis=None,
    )


def main(out):
    out = Path(out)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    is_chief = task["index"] == 0
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == WORKERS
    x, y = regression_data(5, N)

    model, optimizer = fresh_model(strategy)
    train(strategy, model, optimizer, x, y)
    trained = model.get_weights()
    model_iterations = optimizer.iterations.numpy()

    interrupted, optimizer = fresh_model(strategy)
    train(strategy, interrupted, optimizer, x[:SPLIT], y[:SPLIT])
    pending = int(optimizer.micro_steps.numpy())
    # Every task writes (reading the replica-local accumulators is a
    # collective); only the chief's files are the checkpoint.
    name = "checkpoint" if is_chief else f"scratch_{task['index']}"
    tf.train.Checkpoint(model=interrupted, optimizer=optimizer).write(
        str(out / name / "ckpt")
    )
    barrier(strategy)  # the chief's checkpoint is complete
    restored, optimizer = fresh_model(strategy)
    tf.train.Checkpoint(model=restored, optimizer=optimizer).read(
        str(out / "checkpoint" / "ckpt")
    ).assert_consumed()
    train(strategy, restored, optimizer, x[SPLIT:], y[SPLIT:])

    if is_chief:
        np.savez(
            out / "weights.npz",
            pending=pending,
            iterations=int(model_iterations),
            **{f"fit_{i}": w for i, w in enumerate(trained)},
            **{f"resumed_{i}": w for i, w in enumerate(restored.get_weights())},
        )


if __name__ == "__main__":
    keras.config.disable_traceback_filtering()
    main(sys.argv[1])
