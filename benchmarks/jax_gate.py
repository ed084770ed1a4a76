"""Why the JAX gate is a while loop: XLA cost of each way to gate.

    python -m benchmarks.jax_gate

The JAX twin of `benchmarks.xla_gate`. Times one `jax.jit` step, with the
state donated as Keras' trainer donates it, on four 1.3 M-float arrays (a
weight, Adam's two moments, an accumulator, the MLP's size): the step adds a
gradient into the accumulator and, gated, runs an Adam-like update of the
other three. Each gate is timed with the update not taken and taken:

- `add_only`: no update at all (the floor);
- `cond`: the update in a `lax.cond` branch;
- `while`: the update in a `lax.while_loop` that runs zero times or once;
- `always`: the update every step (no gate).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

SIZE = 1_300_000
GATES = ("add_only", "cond", "while", "always")


def update(state):
    weight, m, v, accumulator = state
    grad = accumulator / 4.0
    m = 0.9 * m + 0.1 * grad
    v = 0.999 * v + 0.001 * grad * grad
    weight = weight - 0.001 * m / (jnp.sqrt(v) + 1e-7)
    return weight, m, v, jnp.zeros_like(accumulator)


def make_step(gate):
    def step(state, grad, taken):
        weight, m, v, accumulator = state
        state = weight, m, v, accumulator + grad
        if gate == "cond":
            return jax.lax.cond(taken, update, lambda state: state, state)
        if gate == "while":
            _, state = jax.lax.while_loop(
                lambda carry: carry[0],
                lambda carry: (jnp.array(False), update(carry[1])),
                (taken, state),
            )
            return state
        if gate == "always":
            return update(state)
        return state

    return jax.jit(step, donate_argnums=0)


def milliseconds(step, taken, calls=300, rounds=5):
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    state = tuple(jax.random.normal(key, [SIZE]) for key in keys[:4])
    grad = jax.random.normal(keys[4], [SIZE])
    flag = jnp.array(taken)
    for _ in range(20):
        state = step(state, grad, flag)
    jax.block_until_ready(state)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            state = step(state, grad, flag)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    print(
        "jax.jit, donated state; ms per step "
        f"(median of 5 x {args.calls} calls)"
    )
    print("| gate | not taken | taken |")
    print("|---|---|---|")
    for gate in GATES:
        step = make_step(gate)
        skipped = milliseconds(step, False, args.calls)
        taken = milliseconds(step, True, args.calls)
        print(f"| {gate} | {skipped:.2f} | {taken:.2f} |", flush=True)


if __name__ == "__main__":
    main()
