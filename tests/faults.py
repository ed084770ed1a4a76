"""Faults for `test_fault_injection.py`: an error raised at a chosen point
of a training step, while the step runs (not while it is traced), in every
execution mode.

`Fault(error)` counts the runtime passes of a point and raises on the
`at`-th one (counting from 0). `fault.tap(tensor)` returns `tensor`
unchanged, but only after the check ran: a Python check eagerly (torch,
TensorFlow eager), a `tf.py_function` in a TensorFlow graph, a
`jax.pure_callback` on JAX (in `jit` and eagerly). Where the tap cannot run
(TensorFlow's XLA compiles no Python), `tap_supported` says so.

The points, each through public Keras: the data (`FailingData`, a
`PyDataset`), the forward pass (`Tripwire` in the model), the backward pass
(`Tripwire(backward=True)`: a custom gradient), the parent's update
(`patch_parent_update_step`: the Keras parent class's `update_step`, which
the window's close calls once per variable) and a callback (`FailingCallback`).
The model's optimizer may be a `MultiOptimizer` of accumulating optimizers:
`state_of` reads every inner optimizer's state.
"""

import contextlib

import keras
import numpy as np

BACKEND = keras.backend.backend()
MESSAGE = "injected fault"


def runtime_error():
    return RuntimeError(f"{MESSAGE}: RuntimeError")


def out_of_memory_error():
    """What each backend raises when a step runs out of memory (see
    `accum_optimizers._backend.is_out_of_memory`)."""
    text = f"RESOURCE_EXHAUSTED: Out of memory ({MESSAGE})"
    if BACKEND == "tensorflow":
        # `tf.py_function` turns a `MemoryError` into TensorFlow's
        # `ResourceExhaustedError`; eagerly, raise that one.
        return MemoryError(text)
    if BACKEND == "jax":
        import jax

        return jax.errors.JaxRuntimeError(text)
    import torch

    return torch.OutOfMemoryError(f"CUDA out of memory. {text}")


class Fault:
    """Raises `make_error()` on the `at`-th runtime pass of its taps."""

    def __init__(self, make_error=runtime_error, at=None):
        self.make_error = make_error
        self.at = at
        self.calls = 0
        self.raised = 0

    def check(self, in_py_function=False):
        call = self.calls
        self.calls += 1
        if self.at is not None and call == self.at:
            self.raised += 1
            error = self.make_error()
            if isinstance(error, MemoryError) and not in_py_function:
                import tensorflow as tf

                error = tf.errors.ResourceExhaustedError(None, None, str(error))
            raise error

    def tap(self, tensor):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            if tf.executing_eagerly():
                self.check()
                return tensor

            def check():
                self.check(in_py_function=True)
                return np.int32(0)

            token = tf.py_function(check, [], tf.int32)
            with tf.control_dependencies([token]):
                return tf.identity(tensor)
        if BACKEND == "jax":
            import jax

            def check():
                self.check()
                return np.zeros((), "float32")

            zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), "float32"))
            return tensor + keras.ops.cast(zero, tensor.dtype)
        self.check()
        return tensor


def tap_supported(jit_compile):
    """Whether a tap can raise inside the step: not under TensorFlow's XLA,
    which compiles no Python."""
    return not (BACKEND == "tensorflow" and jit_compile is True)


class Tripwire(keras.layers.Layer):
    """The identity, whose forward (or, with `backward=True`, backward)
    pass goes through `fault.tap` in training."""

    def __init__(self, fault, backward=False, **kwargs):
        super().__init__(**kwargs)
        self.fault = fault
        self.backward = backward

    def call(self, x, training=False):
        if not training:
            return x
        if not self.backward:
            return self.fault.tap(x)
        fault = self.fault

        @keras.ops.custom_gradient
        def identity(x):
            def grad(*args, upstream=None):
                upstream = args[0] if upstream is None else upstream
                return fault.tap(upstream)

            return x, grad

        return identity(x)


def model_with(forward=None, backward=None, seed=3):
    """Dense 4 -> 6 -> 2, with a forward and a backward tripwire between."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((4,)), keras.layers.Dense(6, activation="tanh")]
    if forward is not None:
        layers.append(Tripwire(forward))
    if backward is not None:
        layers.append(Tripwire(backward, backward=True))
    layers.append(keras.layers.Dense(2))
    return keras.Sequential(layers)


class FailingData(keras.utils.PyDataset):
    """Micro-batches of `(x, y)`; `__getitem__` raises at batch `at`."""

    def __init__(self, x, y, batch_size, fault):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
        self.fault = fault

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        if index == self.fault.at:
            self.fault.calls += 1
            self.fault.raised += 1
            raise self.fault.make_error()
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


class FailingCallback(keras.callbacks.Callback):
    """Raises from `on_train_batch_end` after batch `fault.at`."""

    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.fault.at:
            self.fault.raised += 1
            raise self.fault.make_error()


@contextlib.contextmanager
def patch_parent_update_step(parent_class, fault):
    """With a `fault` (`None`: no patch), the update of `parent_class` (a
    public Keras optimizer class, the parent of ours) taps each variable's
    gradient:
    each variable's update in a window's close is one pass, in variable
    order. On TensorFlow and JAX that is `update_step`; on torch, Keras
    runs the fused `_parallel_update_step` of its torch twin of the class
    (the one private name here), tapping every gradient before it runs."""
    if fault is None:  # nothing to inject: nothing patched
        yield
        return
    if BACKEND == "torch":
        owner = next(
            c
            for c in type(parent_class.__new__(parent_class)).__mro__
            if "_parallel_update_step" in vars(c)
        )
        name = "_parallel_update_step"
        original = vars(owner)[name]

        def patched(self, grads, variables, learning_rate):
            grads = [fault.tap(g) for g in grads]
            return original(self, grads, variables, learning_rate)

    else:
        owner, name = parent_class, "update_step"
        original = vars(owner)[name]

        def patched(self, gradient, variable, learning_rate):
            return original(self, fault.tap(gradient), variable, learning_rate)

    setattr(owner, name, patched)
    try:
        yield
    finally:
        setattr(owner, name, original)


class Snapshot(keras.callbacks.Callback):
    """The model's weights and its optimizer's variables after each
    successful step (and before the first): the state a failing step must
    leave. Reading them each batch also makes JAX's `fit` put its state on
    the variables."""

    def __init__(self, optimizer_of):
        super().__init__()
        self.optimizer_of = optimizer_of
        self.state = None
        self.steps = 0

    def take(self, model):
        self.state = state_of(model, self.optimizer_of(model))

    def on_train_begin(self, logs=None):
        self.take(self.model)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        self.take(self.model)


def state_of(model, optimizer):
    """The model's weights and the optimizer's variables, by path; under a
    `MultiOptimizer`, every inner optimizer's. (The wrapper's own
    `iteration` is Keras' count of its calls, which a TensorFlow graph adds
    to without waiting for the step's gradients, as Keras' optimizers do
    their `iterations`.)"""
    multi = getattr(keras.optimizers, "MultiOptimizer", ())
    optimizers = (
        optimizer.optimizers if isinstance(optimizer, multi) else [optimizer]
    )
    return {
        "weights": [np.array(w) for w in model.get_weights()],
        "optimizer": {
            v.path: np.array(keras.ops.convert_to_numpy(v.value))
            for inner in optimizers
            for v in inner.variables
        },
    }


def differences(actual, expected):
    """The names of the weights and optimizer variables that differ."""
    changed = [
        f"weight {n}"
        for n, (a, e) in enumerate(zip(actual["weights"], expected["weights"]))
        if not np.array_equal(a, e, equal_nan=True)
    ]
    changed += [
        path
        for path, value in expected["optimizer"].items()
        if not np.array_equal(
            actual["optimizer"].get(path), value, equal_nan=True
        )
    ]
    return changed
