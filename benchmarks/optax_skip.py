"""`skip_nonfinite` against optax, the one rival that skips a non-finite
micro-batch.

    KERAS_BACKEND=jax python -m benchmarks.optax_skip [--workload mlp]
                                                  [--windows 40]
                                                  [--micro-batch 32]

Times four train steps of the workload's model under `jax.jit` (the state
donated, as `fit` does), alternating as `benchmarks.window_steps` does:
ours (`AdamAccumulate(accum_iters=4)`, Keras' own `train_step`) without and
with `skip_nonfinite=True`, and `optax.MultiSteps(optax.adam(...), 4)`
without and with `should_skip_update_fn=optax.skip_not_finite`, which
differentiates the same model's `stateless_call` and loss. Prints ms per
micro-step by position in a window of 4, the mean, and each skip's cost
against its own accumulation. Needs optax (`pip install optax`).
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

from benchmarks import window_steps  # noqa: E402
from benchmarks import worker  # noqa: E402
from benchmarks import workloads  # noqa: E402


def optax_steps(workload, micro_batch):
    """Returns `{config: step}` for optax's `MultiSteps` Adam, without
    (`optax_k4`) and with (`optax_k4_skip`) `skip_not_finite`, each a
    synchronous jitted step on the workload's model."""
    import jax
    import optax

    x, y = workloads.data(workload, micro_batch)
    model = workloads.build(workload)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable):
        logits, _ = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        return loss_fn(y, logits)

    steps = {}
    for config, skip in (("optax_k4", None), ("optax_k4_skip", True)):
        # Keras' Adam defaults, epsilon included.
        multi = optax.MultiSteps(
            optax.adam(1e-3, b1=0.9, b2=0.999, eps=1e-7),
            worker.K,
            should_skip_update_fn=optax.skip_not_finite if skip else None,
        )

        def update(params, state, multi=multi):
            grads = jax.grad(loss)(params)
            updates, state = multi.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        step = jax.jit(update, donate_argnums=(0, 1))
        params = [jax.numpy.copy(v.value) for v in model.trainable_variables]
        state = [params, multi.init(params)]

        def run(step=step, state=state):
            state[:] = step(*state)
            jax.block_until_ready(state)

        steps[config] = run
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", default="mlp", choices=workloads.WORKLOADS
    )
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=None)
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        parser.error(f"needs KERAS_BACKEND=jax, not {keras.backend.backend()}")
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error(f"--micro-batch must be >= 1, not {args.micro_batch}")
    batch = args.micro_batch or workloads.WORKLOADS[args.workload][0]
    steps = {
        config: step
        for config, (step, _) in window_steps.skip_toggled_steps(
            args.workload, "adam", micro_batch=batch
        ).items()
    }
    steps.update(optax_steps(args.workload, batch))
    means = {}
    print(f"{args.workload}, micro-batch {batch}, jax.jit; ms per call")
    print("| configuration | 1 | 2 | 3 | 4 | mean |")
    print("|---|---|---|---|---|---|")
    for config, ms in window_steps.profile(steps, args.windows).items():
        means[config] = sum(ms) / len(ms)
        cells = " | ".join(f"{m:.2f}" for m in ms)
        print(f"| {config} | {cells} | {means[config]:.2f} |", flush=True)
    for ours, skip in (
        ("ours_k4", "ours_k4_skip"),
        ("optax_k4", "optax_k4_skip"),
    ):
        print(f"{skip} / {ours}: {means[skip] / means[ours]:.3f}")
    rival = means["optax_k4_skip"] / means["ours_k4_skip"]
    print(f"optax_k4_skip / ours_k4_skip: {rival:.3f}")


if __name__ == "__main__":
    main()
