"""The memory bound of a compiled train step: the parent's peak plus at
most one float32 sum per parameter (`extra / sums <= 1.05`).

The oracle is XLA's own memory analysis of Keras' train step (see
`benchmarks/memory.py`): on JAX as `fit` compiles it, on TensorFlow the
HLO of `tf.function(jit_compile=True)` compiled by jaxlib's XLA. The MLP
is parameter-heavy (3.4 M parameters, micro-batch 32), where XLA used to
hold every window's mean beside the sums (1.33x). torch's CPU allocator
keeps no statistics: not applicable there.
"""

import keras
import pytest

pytestmark = pytest.mark.backends("jax", "tensorflow")

SIZES = [
    "--mlp-width", "1024", "--mlp-depth", "4", "--mlp-input", "256",
    "--mlp-batch", "32",
]  # fmt: skip


def test_compiled_step_stays_within_the_memory_bound():
    from benchmarks import memory

    mode = {"jax": "jax", "tensorflow": "tensorflow-xla"}[
        keras.backend.backend()
    ]
    args = memory.parse(SIZES)
    parent = memory.measure(mode, "mlp", "parent", args)
    ours = memory.measure(mode, "mlp", "ours_k4", args)
    extra = (ours["peak_bytes"] - parent["peak_bytes"]) / ours["sums_bytes"]
    assert 0 < extra <= 1.05, extra
