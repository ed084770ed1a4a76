"""Per-backend pieces of the accumulation mechanism, behind one interface.

Each backend module exposes the same seven names:

- `fused_parent(parent)`: the class an accumulating optimizer should
  subclass for the Keras optimizer `parent`. On torch this is Keras' fused
  `_parallel_update_step` variant of the same optimizer (Keras swaps it in
  only for its own exact classes); elsewhere it is `parent` itself.
- `colocate_with(optimizer, variable)`: a context manager that places
  optimizer variables created in it with the model `variable` (under a
  `tf.distribute` strategy; a no-op elsewhere).
- `accumulate(optimizer, accumulators, grads, micro_steps, update_switch,
  apply_window)`: one micro-step, after the counter: when the scalar
  boolean `update_switch` is true, `apply_window(totals)` with `totals` the
  window's gradient sums (`accumulators + grads`, one per accumulator),
  else `accumulators += grads` (a `None` grad adds nothing). `micro_steps`
  counts this micro-batch; on a window's first (`micro_steps == 1`) the
  accumulators may still hold the previous window's sums (see
  `end_window`) and must be overwritten. Where the add happens (before the
  branch or in it) is each backend's cheapest arrangement.
- `sum_over_replicas(values)`: `values` summed over the replicas of a
  `tf.distribute` strategy, in replica context; `values` elsewhere (a
  keras.distribution program sees global arrays).
- `window_mean(totals, micro_steps)`: `totals / micro_steps`; on torch in
  place (the totals are the accumulators, which `end_window` zeroes next).
- `end_window(optimizer)`: starts a new window: sets the micro-step
  counter to zero and, on torch (in place, `_foreach_zero_`), the
  accumulators too; TensorFlow and JAX leave them for the next window's
  first micro-step to overwrite, which is cheaper there.
- `run_if(optimizer, pred, fn)`: run `fn()` (which assigns optimizer and
  model variables) only when the scalar boolean `pred` is true, without
  computing `fn`'s math when it is false, in eager and in compiled code.
"""

from keras import backend

_name = backend.backend()
if _name == "tensorflow":
    from accum_optimizers._backend.tensorflow import accumulate
    from accum_optimizers._backend.tensorflow import colocate_with
    from accum_optimizers._backend.tensorflow import end_window
    from accum_optimizers._backend.tensorflow import fused_parent
    from accum_optimizers._backend.tensorflow import run_if
    from accum_optimizers._backend.tensorflow import sum_over_replicas
    from accum_optimizers._backend.tensorflow import window_mean
elif _name == "jax":
    from accum_optimizers._backend.jax import accumulate
    from accum_optimizers._backend.jax import colocate_with
    from accum_optimizers._backend.jax import end_window
    from accum_optimizers._backend.jax import fused_parent
    from accum_optimizers._backend.jax import run_if
    from accum_optimizers._backend.jax import sum_over_replicas
    from accum_optimizers._backend.jax import window_mean
elif _name == "torch":
    from accum_optimizers._backend.torch import accumulate
    from accum_optimizers._backend.torch import colocate_with
    from accum_optimizers._backend.torch import end_window
    from accum_optimizers._backend.torch import fused_parent
    from accum_optimizers._backend.torch import run_if
    from accum_optimizers._backend.torch import sum_over_replicas
    from accum_optimizers._backend.torch import window_mean
else:
    raise ImportError(
        "accum_optimizers supports the Keras backends 'tensorflow', 'jax' "
        f"and 'torch'. Received: KERAS_BACKEND={_name!r}"
    )

__all__ = [
    "accumulate",
    "colocate_with",
    "end_window",
    "fused_parent",
    "run_if",
    "sum_over_replicas",
    "window_mean",
]
