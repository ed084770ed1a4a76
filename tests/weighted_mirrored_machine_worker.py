"""Worker for test_weighted_distributed.py: drawn weighted custom loops
mirrored, checked after every step.

    KERAS_BACKEND=tensorflow python weighted_mirrored_machine_worker.py OUT

Hypothesis draws sequences of what a custom loop under
`tf.distribute.MirroredStrategy` (2 logical CPU devices, `mirrored_devices`)
does to an accumulating optimizer: micro-steps inside `strategy.run` in a
`tf.function`, each replica with its own weight (`0` for an empty share)
and gradients, some calls with `None` for a variable, and flushes. After
every step the weights, `iterations`, `samples_seen` and `micro_steps` are
checked against the reference: the parent Keras optimizer on its own
variables, one device, fed each window's global weighted mean gradient
(a variable without gradient in the whole window left alone), and the sum
of every replica's weights over the applied windows. As Keras' losses
under a strategy, each replica's gradient arrives divided by the number of
replicas. The number of drawn sequences follows `HYPOTHESIS_PROFILE`. A
failure raises (hypothesis prints the sequence); otherwise OUT.json gets
the replica count and the number of sequences and steps checked.
"""

import json
import os
import sys
from pathlib import Path

import tensorflow as tf
from mirrored_devices import DEVICES

# The CPU is split (above) before anything below starts TensorFlow.
# isort: split
import keras
import numpy as np
from helpers import PARENTS
from helpers import assert_all_close
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from accum_optimizers import AdamAccumulate
from accum_optimizers import SGDAccumulate

STRATEGY = tf.distribute.MirroredStrategy(DEVICES)
REPLICAS = STRATEGY.num_replicas_in_sync
SHAPES = ((3, 2), (2,))
CLASSES = {
    "adam": (AdamAccumulate, {"learning_rate": 0.05}),
    "sgd": (SGDAccumulate, {"learning_rate": 0.1, "momentum": 0.9}),
}
# Sequences per profile (conftest.py's names): each builds its graphs anew.
EXAMPLES = {"ci": 3, "compat": 2, "thorough": 40}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

# A replica's weight: its count of samples (0: its share is empty), or a
# sum of sample weights.
replica_weights = st.sampled_from([0.0, 1.0, 2.0, 3.0, 0.5, 7.25])
micro_steps = st.fixed_dictionaries(
    {
        "weights": st.lists(replica_weights, min_size=2, max_size=2),
        "seed": st.integers(0, 2**32 - 1),
        # Which variable the call has no gradient for (one graph each).
        "missing": st.sampled_from([None, 0, 1]),
    }
)
actions = st.one_of(micro_steps, st.just("flush"))


def per_replica(values):
    """A distributed value holding `values[r]` on replica r."""
    return STRATEGY.experimental_distribute_values_from_function(
        lambda context: tf.constant(values[context.replica_id_in_sync_group])
    )


class Run:
    """Ours under the strategy, and the reference."""

    def __init__(self, name, accum_iters):
        cls, options = CLASSES[name]
        initial = [np.full(s, 0.5, "float32") for s in SHAPES]
        with STRATEGY.scope():
            self.variables = [keras.Variable(v) for v in initial]
            self.optimizer = cls(accum_iters=accum_iters, **options)
            self.optimizer.build(self.variables)
        self.reference = [keras.Variable(v) for v in initial]
        self.parent = PARENTS[cls](**options)
        self.parent.build(self.reference)
        self.accum_iters = accum_iters
        self.steps = {}  # a graph per missing variable
        # The pending window: per micro-step, per replica, the gradients
        # (None where missing) and the weight.
        self.window = []
        self.iterations, self.samples = 0, 0.0

    def _step(self, missing):
        if missing not in self.steps:

            @tf.function(autograph=False)
            def step(weight, *grads):
                def replica_step(weight, *grads):
                    passed = [
                        None if i == missing else g for i, g in enumerate(grads)
                    ]
                    self.optimizer.apply(passed, self.variables, weight=weight)

                STRATEGY.run(replica_step, args=(weight, *grads))

            self.steps[missing] = step
        return self.steps[missing]

    def micro_step(self, weights, seed, missing):
        rng = np.random.default_rng(seed)
        # Each replica's gradient of its mean loss over its own samples,
        # divided by the number of replicas (Keras' losses under a
        # strategy).
        grads = [
            [rng.normal(size=s).astype("float32") for s in SHAPES]
            for _ in range(REPLICAS)
        ]
        self._step(missing)(
            per_replica([np.float32(w) for w in weights]),
            *(
                per_replica([grads[r][i] / REPLICAS for r in range(REPLICAS)])
                for i in range(len(SHAPES))
            ),
        )
        self.window.append(
            [
                (
                    [None if i == missing else g for i, g in enumerate(gs)],
                    w,
                )
                for gs, w in zip(grads, weights)
            ]
        )
        if len(self.window) == self.accum_iters:
            self._reference_apply()

    def flush(self):
        self.optimizer.flush()
        if self.window:
            self._reference_apply()

    def _reference_apply(self):
        """The window's global weighted mean, over every replica's shares
        of every micro-step; a window whose weights are all 0 has a zero
        gradient (the big batch's `divide_no_nan`)."""
        shares = [share for step in self.window for share in step]
        total = sum(float(w) for _, w in shares)
        indices = [
            i
            for i in range(len(SHAPES))
            if any(grads[i] is not None for grads, _ in shares)
        ]
        means = []
        for i in indices:
            summed = sum(
                float(w) * np.asarray(grads[i], "float64")
                for grads, w in shares
                if grads[i] is not None
            )
            mean = summed / total if total > 0 else np.zeros(SHAPES[i])
            means.append(tf.constant(np.asarray(mean, "float32")))
        if indices:
            self.parent.apply(means, [self.reference[i] for i in indices])
            self.iterations += 1
            self.samples += total
        self.window = []

    def check(self):
        assert_all_close(
            [v.numpy() for v in self.variables],
            [v.numpy() for v in self.reference],
            rtol=1e-5,
            atol=1e-6,
            what="variable",
        )
        optimizer = self.optimizer
        assert int(optimizer.iterations.numpy()) == self.iterations
        assert int(optimizer.micro_steps.numpy()) == len(self.window)
        np.testing.assert_allclose(
            float(optimizer.samples_seen.numpy()), self.samples, rtol=1e-6
        )


checked = {"sequences": 0, "steps": 0}


@settings(
    max_examples=EXAMPLES[PROFILE],
    derandomize=PROFILE != "thorough",
    deadline=None,
    database=None,
    print_blob=True,
)
@given(
    name=st.sampled_from(sorted(CLASSES)),
    accum_iters=st.integers(2, 3),
    sequence=st.lists(actions, min_size=6, max_size=12),
)
def test_drawn_weighted_windows(name, accum_iters, sequence):
    keras.backend.clear_session(free_memory=False)
    run = Run(name, accum_iters)
    for action in sequence:
        if action == "flush":
            run.flush()
        else:
            run.micro_step(**action)
        run.check()
        checked["steps"] += 1
    checked["sequences"] += 1


def main(out_path):
    test_drawn_weighted_windows()
    Path(out_path).write_text(json.dumps({"replicas": REPLICAS, **checked}))


if __name__ == "__main__":
    main(sys.argv[1])
