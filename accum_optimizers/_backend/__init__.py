"""Per-backend pieces of the accumulation mechanism, behind one interface.

Each backend module exposes the same six names:

- `fused_parent(parent)`: the class an accumulating optimizer should
  subclass for the Keras optimizer `parent`. On torch this is Keras' fused
  `_parallel_update_step` variant of the same optimizer (Keras swaps it in
  only for its own exact classes); elsewhere it is `parent` itself.
- `colocate_with(optimizer, variable)`: a context manager that places
  optimizer variables created in it with the model `variable` (under a
  `tf.distribute` strategy; a no-op elsewhere).
- `add_into(optimizer, accumulators, grads)`: `accumulator += grad`, for
  each pair, on the cheapest path the backend has; a `None` grad adds
  nothing. On the first micro-step of a window it must leave each
  accumulator holding that micro-step's gradient (or zeros) even where
  `end_window` left the previous window's sums in it.
- `sum_over_replicas(variables)`: the values of `variables` summed over
  the replicas of a `tf.distribute` strategy, in replica context; their
  values elsewhere (a keras.distribution program sees global arrays).
- `end_window(optimizer)`: starts a new window: sets the micro-step
  counter to zero and, on torch (in place, `_foreach_zero_`), the
  accumulators too; TensorFlow and JAX leave them for `add_into` to
  overwrite, which is cheaper there.
- `run_if(optimizer, pred, fn)`: run `fn()` (which assigns optimizer and
  model variables) only when the scalar boolean `pred` is true, without
  computing `fn`'s math when it is false, in eager and in compiled code.
"""

from keras import backend

_name = backend.backend()
if _name == "tensorflow":
    from accum_optimizers._backend.tensorflow import add_into
    from accum_optimizers._backend.tensorflow import colocate_with
    from accum_optimizers._backend.tensorflow import end_window
    from accum_optimizers._backend.tensorflow import fused_parent
    from accum_optimizers._backend.tensorflow import run_if
    from accum_optimizers._backend.tensorflow import sum_over_replicas
elif _name == "jax":
    from accum_optimizers._backend.jax import add_into
    from accum_optimizers._backend.jax import colocate_with
    from accum_optimizers._backend.jax import end_window
    from accum_optimizers._backend.jax import fused_parent
    from accum_optimizers._backend.jax import run_if
    from accum_optimizers._backend.jax import sum_over_replicas
elif _name == "torch":
    from accum_optimizers._backend.torch import add_into
    from accum_optimizers._backend.torch import colocate_with
    from accum_optimizers._backend.torch import end_window
    from accum_optimizers._backend.torch import fused_parent
    from accum_optimizers._backend.torch import run_if
    from accum_optimizers._backend.torch import sum_over_replicas
else:
    raise ImportError(
        "accum_optimizers supports the Keras backends 'tensorflow', 'jax' "
        f"and 'torch'. Received: KERAS_BACKEND={_name!r}"
    )

__all__ = [
    "add_into",
    "colocate_with",
    "end_window",
    "fused_parent",
    "run_if",
    "sum_over_replicas",
]
