"""Micro-batches that reach different variables, drawn: task heads picked in
Python, experts a router skips, `apply` with `None`s or with only the
variables that have a gradient, in every execution mode (eagerly, in a
`tf.function`, under XLA, under `jax.jit`).

Hypothesis draws the optimizer (its moments, weight decay and clipping
make an update of a zero gradient differ from no update), the window, each
micro-step's reached variables and weight, whether the variables are
passed as a subset, and a trailing partial window that `flush` applies. The
oracle is the parent Keras optimizer fed each window's weighted mean
gradient, updating every variable some micro-step of the window reached
(`helpers.parent_on_window_means`): the big batch's update.

Examples per backend and mode follow `HYPOTHESIS_PROFILE`:

    HYPOTHESIS_PROFILE=thorough KERAS_BACKEND=tensorflow \
        python -m pytest tests/test_reached_subsets.py -q
"""

import os

import keras
import numpy as np
import pytest
from helpers import assert_all_close
from helpers import parent_on_window_means
from helpers import random_variables
from hypothesis import given
from hypothesis import note
from hypothesis import settings
from hypothesis import strategies as st
from modes import MODES
from modes import applier

from accum_optimizers import AdamAccumulate
from accum_optimizers import MuonAccumulate
from accum_optimizers import RMSpropAccumulate
from accum_optimizers import SGDAccumulate

SHAPES = ((3, 2), (2,), (2, 1), (1,))
OPTIMIZERS = {
    "adam": (AdamAccumulate, {"learning_rate": 0.1}),
    "adamw": (AdamAccumulate, {"learning_rate": 0.1, "weight_decay": 0.2}),
    "sgd_momentum_clipnorm": (
        SGDAccumulate,
        {"learning_rate": 0.1, "momentum": 0.9, "clipnorm": 0.5},
    ),
    "rmsprop_global_clipnorm": (
        RMSpropAccumulate,
        {"learning_rate": 0.05, "global_clipnorm": 0.3},
    ),
    # Its own weight decay: Muon's for matrices, AdamW's for the others.
    "muon_decay": (
        MuonAccumulate,
        {"learning_rate": 0.1, "weight_decay": 0.1, "adam_weight_decay": 0.3},
    ),
}
EXAMPLES = {"ci": 4, "compat": 2}.get(
    os.environ.get("HYPOTHESIS_PROFILE", "ci"), 60
)


@st.composite
def runs(draw):
    """`(optimizer, k, windows, weights, pending, subset)`: whole windows
    and a trailing partial one (`pending`, possibly empty), each micro-step
    a set of reached variable indices (never empty)."""
    k = draw(st.integers(2, 3))
    reached = st.sets(st.integers(0, len(SHAPES) - 1), min_size=1)
    count = draw(st.integers(1, 3)) * k + draw(st.integers(0, k - 1))
    steps = draw(st.lists(reached, min_size=count, max_size=count))
    weights = draw(
        st.lists(
            st.one_of(st.none(), st.sampled_from([0.5, 2.0, 7.0])),
            min_size=count,
            max_size=count,
        )
    )
    return (
        draw(st.sampled_from(sorted(OPTIMIZERS))),
        k,
        steps,
        weights,
        draw(st.booleans()),
    )


@pytest.mark.parametrize("mode", MODES)
def test_windows_whose_micro_batches_reach_drawn_subsets_are_the_big_batch(
    mode,
):
    @settings(max_examples=EXAMPLES)
    @given(run=runs(), seed=st.integers(0, 2**16))
    def check(run, seed):
        name, k, steps, weights, subset = run
        if mode == "jit":
            subset = False  # stateless_apply takes one gradient a variable
        note(f"{name} k={k} steps={steps} weights={weights} subset={subset}")
        keras.backend.clear_session(free_memory=False)
        cls, options = OPTIMIZERS[name]
        rng = np.random.default_rng(seed)
        calls = [
            [
                rng.normal(size=s).astype("float32") if i in reached else None
                for i, s in enumerate(SHAPES)
            ]
            for reached in steps
        ]
        ours_vars = random_variables(seed, SHAPES)
        ours = cls(accum_iters=k, **options)
        step = applier(ours, ours_vars, mode, subset=subset)
        for grads, weight in zip(calls, weights):
            step(grads, weight=weight)
        ours.flush()

        parent_vars = random_variables(seed, SHAPES)
        closed = len(calls) // k * k
        windows = [calls[i : i + k] for i in range(0, closed, k)]
        window_weights = [weights[i : i + k] for i in range(0, closed, k)]
        if closed < len(calls):
            windows.append(calls[closed:])
            window_weights.append(weights[closed:])
        parent = cls.parent_class(**options)
        parent.build(parent_vars)
        parent_on_window_means(parent, parent_vars, windows, window_weights)
        assert_all_close(ours_vars, parent_vars, rtol=1e-5, atol=1e-6)
        assert int(ours.iterations) == len(windows)

    check()
