"""Importing the package changes nothing in Keras or TensorFlow: every
attribute of every class `keras.optimizers` exports (and of the Keras
classes they inherit from) is the one Keras defined, and AutoGraph's
conversion rules are TensorFlow's, also once a wrapper cooperates with an
accumulating optimizer (which changes that instance only), and Keras' loss
reduction is its own after `weigh_micro_batches` trained. Keras' own tests
of the wrappers pass with every wrapper cooperating, and of its losses
while their reductions are recorded."""

import json
import os
import pathlib
import subprocess
import sys

import keras
import pytest

BACKEND = keras.backend.backend()
ROOT = pathlib.Path(__file__).resolve().parent.parent

# Run in a fresh process: the snapshot is taken with only Keras imported.
_SNAPSHOT = r"""
import json
import keras

def keras_classes():
    seen = {}
    for value in vars(keras.optimizers).values():
        if isinstance(value, type):
            for cls in value.__mro__:
                if cls.__module__.startswith("keras"):
                    seen[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return seen

def snapshot():
    return {
        (name, attribute): value
        for name, cls in keras_classes().items()
        for attribute, value in vars(cls).items()
    }

def conversion_rules():
    if keras.backend.backend() != "tensorflow":
        return None
    from tensorflow.python.autograph.core import config
    return config.CONVERSION_RULES

from keras.src.losses import loss as loss_module

before, rules = snapshot(), conversion_rules()
reduction = loss_module.reduce_weighted_values
import accum_optimizers

# Cooperation met, used and saved: a loss scale, a MultiOptimizer.
variables = [keras.Variable([1.0, 2.0]), keras.Variable([3.0])]
inner = accum_optimizers.SGDAccumulate(0.1, accum_iters=2)
wrapper = keras.optimizers.LossScaleOptimizer(inner)
grads = [keras.ops.ones((2,)), keras.ops.ones((1,))]
wrapper.build(variables)
wrapper.scale_loss(keras.ops.ones(()))
if keras.backend.backend() != "jax":  # stateless only on JAX
    wrapper.apply(grads, variables, weight=2.0)
adam = accum_optimizers.AdamAccumulate(accum_iters=2)
multi = keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(adam))
multi.apply(grads, variables)
# `weigh_micro_batches` in a `fit`: Keras' loss reduction is its own after.
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(
    optimizer=accum_optimizers.SGDAccumulate(accum_iters=2), loss="mse"
)
accum_optimizers.weigh_micro_batches(model)
x, y = keras.ops.ones((4, 2)), keras.ops.ones((4, 1))
model.fit(x, y, batch_size=2, verbose=0)
after = snapshot()
changed = sorted(
    f"{name}.{attribute}"
    for name, attribute in before.keys() | after.keys()
    if before.get((name, attribute)) is not after.get((name, attribute))
)
print(json.dumps({
    "classes": len(keras_classes()),
    "changed": changed,
    "rules_kept": conversion_rules() is rules,
    "loss_reduction_kept": loss_module.reduce_weighted_values is reduction,
    "cooperating": [
        "apply" in vars(w) for w in (wrapper, multi)
    ],
}))
"""


def _run(args, **kwargs):
    env = {**os.environ, "KERAS_BACKEND": BACKEND}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        **kwargs,
    )


def test_importing_and_cooperating_changes_no_keras_class_nor_autograph():
    done = _run(["-c", _SNAPSHOT])
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["classes"] > 10  # the optimizers and their bases
    assert found["changed"] == [], found["changed"]
    assert found["rules_kept"]
    assert found["loss_reduction_kept"]
    assert found["cooperating"] == [True, True]  # the cooperation ran


def test_keras_own_wrapper_tests_pass_with_every_wrapper_cooperating(
    tmp_path,
):
    # Keras' test files in the installed wheel; `MultiOptimizer` arrived
    # in Keras 3.15.0.
    folder = pathlib.Path(keras.__file__).parent / "src" / "optimizers"
    files = [
        str(path)
        for name in ("loss_scale_optimizer_test.py", "multi_optimizer_test.py")
        if (path := folder / name).exists()
    ]
    if not files:
        pytest.skip(f"Keras {keras.__version__} ships no wrapper tests")
    made = tmp_path / "made"
    os.environ["COOPERATING_WRAPPERS_FILE"] = str(made)
    try:
        done = _run(
            [
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "tests.keras_wrapper_plugin",
                "--rootdir",
                str(tmp_path),
                "-c",
                os.devnull,
                *files,
            ]
        )
    finally:
        del os.environ["COOPERATING_WRAPPERS_FILE"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert made.read_text().split(), "no wrapper cooperated"


def test_keras_own_loss_tests_pass_while_their_reductions_are_recorded(
    tmp_path,
):
    path = pathlib.Path(keras.__file__).parent / "src" / "losses"
    recorded = tmp_path / "recorded"
    os.environ["RECORDED_REDUCTIONS_FILE"] = str(recorded)
    try:
        done = _run(
            [
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-p",
                "tests.keras_loss_plugin",
                "--rootdir",
                str(tmp_path),
                "-c",
                os.devnull,
                str(path / "loss_test.py"),
            ]
        )
    finally:
        del os.environ["RECORDED_REDUCTIONS_FILE"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert int(recorded.read_text()) > 0, "no reduction was recorded"
