"""Time per window on paper: DDP every micro-step, `sync_windows` at the
close, and `sync_windows(model=)` behind the last backward.

    python -m benchmarks.ddp_model --compute-ms 40 [--grad-bytes 5292072]
        [--accum-iters 4] [--hidden-share 0.5]
        [--gbits 1 10 100] [--ranks 2 4 8 16 32 64]

Inputs, measured: `--compute-ms`, one micro-step's forward, backward and
`apply` without any exchange (`benchmarks.torch_ddp` prints it as
`per_window`'s "other micro-steps"), and `--grad-bytes`, the bytes of the
gradients one rank sends into an all-reduce (the sums: it prints them too;
the default is its MLP's, 1,323,018 float32 parameters). Assumed:
`--hidden-share`, the share of a micro-step's time that runs after its
first bucket is ready (the backward's rest), behind which an exchange can
hide.

A ring all-reduce of `S` bytes over `p` ranks sends and receives
`2 (p - 1) / p * S` bytes per rank; at `G` Gbit/s it takes
`A = 2 (p - 1) / p * S / (G * 1e9 / 8)` seconds (bandwidth only: latency,
the update's own time, and contention are left out). With `t` the compute
time per micro-step, `h` the hidden share and `k = accum_iters`:

- DDP every micro-step: `k * (t + max(0, A - h t))` (one exchange per
  micro-step, each hidden behind its backward as far as it goes);
- `sync_windows` at the close: `k t + A` (one exchange, after the last
  backward);
- `sync_windows(model=)`: `k t + max(0, A - h t)` (one exchange, hidden
  behind the last backward as far as it goes).

Prints a markdown table of milliseconds per window.
"""

import argparse
import sys

# The benchmark MLP's parameters (256-1024-1024-10), in float32.
MLP_GRAD_BYTES = 4 * (256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute-ms", type=float, required=True)
    parser.add_argument("--grad-bytes", type=int, default=MLP_GRAD_BYTES)
    parser.add_argument("--accum-iters", type=int, default=4)
    parser.add_argument("--hidden-share", type=float, default=0.5)
    parser.add_argument(
        "--gbits", type=float, nargs="+", default=[1.0, 10.0, 100.0]
    )
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64]
    )
    args = parser.parse_args(argv)
    checks = {
        "compute_ms": args.compute_ms > 0,
        "grad_bytes": args.grad_bytes > 0,
        "accum_iters": args.accum_iters >= 1,
        "hidden_share": 0 <= args.hidden_share <= 1,
        "gbits": all(g > 0 for g in args.gbits),
        "ranks": all(p >= 2 for p in args.ranks),
    }
    for name, good in checks.items():
        if not good:
            parser.error(
                f"--{name.replace('_', '-')} is out of range: "
                f"{name}={getattr(args, name)!r}"
            )
    return args


def all_reduce_s(grad_bytes, ranks, gbits):
    """Seconds of a ring all-reduce of `grad_bytes` over `ranks` at
    `gbits` Gbit/s, bandwidth only."""
    return 2 * (ranks - 1) / ranks * grad_bytes / (gbits * 1e9 / 8)


def window_s(compute_s, exchange_s, accum_iters, hidden_share):
    """`{way: seconds per window}` for the three ways (see the module
    docstring), given one micro-step's compute and one exchange."""
    exposed = max(0.0, exchange_s - hidden_share * compute_s)
    return {
        "ddp_every_step": accum_iters * (compute_s + exposed),
        "sync_at_close": accum_iters * compute_s + exchange_s,
        "sync_overlap": accum_iters * compute_s + exposed,
    }


def table(args):
    """The markdown table of milliseconds per window."""
    lines = [
        "| Gbit/s | ranks | all-reduce (ms) | DDP every micro-step (ms) "
        "| at the close (ms) | overlapped (ms) | overlapped / DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    compute_s = args.compute_ms / 1e3
    for gbits in args.gbits:
        for ranks in args.ranks:
            exchange = all_reduce_s(args.grad_bytes, ranks, gbits)
            ways = window_s(
                compute_s, exchange, args.accum_iters, args.hidden_share
            )
            ms = {way: 1e3 * s for way, s in ways.items()}
            ratio = ways["sync_overlap"] / ways["ddp_every_step"]
            lines.append(
                f"| {gbits:g} | {ranks} | {1e3 * exchange:.1f} "
                f"| {ms['ddp_every_step']:.1f} | {ms['sync_at_close']:.1f} "
                f"| {ms['sync_overlap']:.1f} | {ratio:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    args = parse(argv)
    print(
        f"compute {args.compute_ms:g} ms per micro-step, "
        f"{args.grad_bytes} gradient bytes per rank, "
        f"accum_iters={args.accum_iters}, hidden share {args.hidden_share:g}"
    )
    print(table(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
