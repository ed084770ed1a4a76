"""torch DDP: gradients exchanged every micro-step, or once per window
(at its close, or behind its last backward).

    python -m benchmarks.torch_ddp [--ranks 2] [--accum-iters 4]
                                   [--micro-batch 32] [--windows 6]
                                   [--repeats 5] [--width 1024] [--smoke]

Starts `--ranks` CPU processes (gloo over 127.0.0.1), each training the
same Keras MLP (256-width-width-10) wrapped in `DistributedDataParallel`,
with `AdamAccumulate(accum_iters=k)` in a custom loop, three ways, side
by side, interleaved over `--repeats` rounds:

- `every_step`: plain DDP, which all-reduces the gradients in every
  `backward` (k exchanges per window);
- `per_window`: every backward under `ddp.no_sync()`, and the optimizer
  under `accum_optimizers.torch_distributed.sync_windows` (one exchange per
  window, at its close);
- `overlap`: the same with `sync_windows(model=model)`, which starts each
  bucket's all-reduce during the window's last backward, and waits for it
  at the close.

Prints, for each, the median micro-batch samples/s over all ranks, the
all-reduce calls per window, the time of the window's last micro-step
(forward, backward and `apply`: where the window's exchange waits) and of
the other micro-steps (median over windows and rounds, slowest rank), and
the ratios. `per_window`'s other micro-steps exchange nothing: their time
is the compute time per micro-step that `benchmarks.ddp_model` takes. On
one machine's CPU the exchange is cheap (shared memory); between machines
it is the network.
"""

import argparse
import datetime
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("every_step", "per_window", "overlap")
# How long a rank waits for the others in a collective, and to leave.
GROUP_TIMEOUT_S = 120
TEARDOWN_TIMEOUT_S = 60


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--accum-iters", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--rank", type=int, default=None, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.windows, args.repeats, args.width = 1, 1, 64
    return args


def rank_main(args):
    import contextlib

    import keras
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from accum_optimizers import AdamAccumulate
    from accum_optimizers.torch_distributed import sync_windows

    # Shorter than any caller's patience: a rank left alone fails.
    dist.init_process_group(
        "gloo",
        init_method=os.environ["ACCUM_INIT_METHOD"],
        rank=args.rank,
        world_size=args.ranks,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    calls = {"all_reduce": 0, "backward": 0}

    def counting_hook(state, bucket):
        # DDP's default exchange (sum / world size), counted.
        calls["backward"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    original = dist.all_reduce

    def counted(*arguments, **kwargs):
        calls["all_reduce"] += 1
        return original(*arguments, **kwargs)

    dist.all_reduce = counted
    rng = np.random.default_rng(args.rank)
    steps = args.windows * args.accum_iters
    x = torch.from_numpy(
        rng.normal(size=(steps, args.micro_batch, 256)).astype("float32")
    )
    y = torch.from_numpy(rng.integers(0, 10, size=(steps, args.micro_batch)))
    loss_fn = torch.nn.CrossEntropyLoss()
    runs = {}
    for way in WAYS:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((256,)),
                keras.layers.Dense(args.width, activation="relu"),
                keras.layers.Dense(args.width, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, counting_hook)
        optimizer = AdamAccumulate(accum_iters=args.accum_iters)
        if way == "per_window":
            sync_windows(optimizer)
        elif way == "overlap":
            sync_windows(optimizer, model=model)
        runs[way] = (model, ddp, optimizer, [], [], [])

    def train(way):
        """One pass over the data; returns the seconds of each window's
        last micro-step and of the other micro-steps."""
        model, ddp, optimizer = runs[way][:3]
        variables = model.trainable_variables
        quiet = contextlib.nullcontext if way == "every_step" else ddp.no_sync
        last, others = [], []
        for step in range(steps):
            start = time.perf_counter()
            with quiet():
                loss_fn(ddp(x[step]), y[step]).backward()
            with torch.no_grad():
                optimizer.apply([v.value.grad for v in variables], variables)
            model.zero_grad()
            seconds = time.perf_counter() - start
            closes = (step + 1) % args.accum_iters == 0
            (last if closes else others).append(seconds)
        return last, others

    for way in WAYS:  # warm-up (also builds the optimizers)
        train(way)
    counts = {}
    for round_index in range(args.repeats):
        order = WAYS if round_index % 2 == 0 else WAYS[::-1]
        for way in order:
            dist.barrier()
            before = dict(calls)
            start = time.perf_counter()
            last, others = train(way)
            seconds = time.perf_counter() - start
            counts[way] = {k: calls[k] - before[k] for k in calls}
            runs[way][3].append(steps * args.micro_batch * args.ranks / seconds)
            runs[way][4].extend(last)
            runs[way][5].extend(others)
    sums = runs["per_window"][2]._window.sums
    result = {
        way: {
            "samples_per_s": statistics.median(runs[way][3]),
            "all_reduces_per_window": counts[way]["all_reduce"] / args.windows,
            "backward_all_reduces_per_window": counts[way]["backward"]
            / args.windows,
            "last_step_ms": 1e3 * statistics.median(runs[way][4]),
            "micro_step_ms": 1e3 * statistics.median(runs[way][5]),
            "sum_bytes": sum(
                s.value.numel() * s.value.element_size() for s in sums
            ),
        }
        for way in WAYS
    }
    dist.all_reduce = original
    gathered = [None] * args.ranks
    dist.all_gather_object(gathered, result)
    if args.rank == 0:
        print(json.dumps(gathered), flush=True)
    # A rank has hung after its results were in: the ranks leave the
    # group together, then end at once, skipping the interpreter's
    # teardown (the stacks go to stderr if leaving stalls).
    faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_S, exit=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(args, argv, store):
    """Runs every rank, meeting through the file `store` (a port picked
    beforehand can be taken by another process before rank 0 binds it);
    kills the others when one fails. Returns (exit codes, rank 0's
    output)."""
    processes = []
    for rank in range(args.ranks):
        env = dict(
            os.environ,
            KERAS_BACKEND="torch",
            ACCUM_INIT_METHOD=f"file://{store}",
            OMP_NUM_THREADS="1",
            TF_CPP_MIN_LOG_LEVEL="3",
        )
        command = [sys.executable, "-m", "benchmarks.torch_ddp", *argv]
        processes.append(
            subprocess.Popen(
                command + ["--rank", str(rank)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                text=True,
            )
        )
    try:
        out, _ = processes[0].communicate()
        for process in processes[1:] if processes[0].returncode == 0 else []:
            # Past the group's timeout a rank waiting for a dead one fails.
            process.wait(timeout=GROUP_TIMEOUT_S + 30)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [process.returncode for process in processes], out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.rank is not None:
        return rank_main(args)
    with tempfile.TemporaryDirectory() as rendezvous:
        codes, out = run_ranks(args, argv, Path(rendezvous) / "store")
    if any(codes):
        print(f"a rank failed (exit codes {codes})", file=sys.stderr)
        return 1
    ranks = json.loads(out.splitlines()[-1])
    print(
        "| way | samples/s (median, slowest rank) | all-reduces per window "
        "| of them in backward (DDP) | last micro-step (ms) "
        "| other micro-steps (ms) |"
    )
    print("|---|---|---|---|---|---|")
    rates, last = {}, {}
    for way in WAYS:
        rates[way] = min(r[way]["samples_per_s"] for r in ranks)
        last[way] = max(r[way]["last_step_ms"] for r in ranks)
        others = max(r[way]["micro_step_ms"] for r in ranks)
        counted = ranks[0][way]
        print(
            f"| {way} | {rates[way]:.0f} "
            f"| {counted['all_reduces_per_window']:.0f} "
            f"| {counted['backward_all_reduces_per_window']:.0f} "
            f"| {last[way]:.2f} | {others:.2f} |"
        )
    for way in ("per_window", "overlap"):
        ratio = rates[way] / rates["every_step"]
        print(f"\n{way} / every_step (samples/s): {ratio:.2f}", end="")
    ratio = last["overlap"] / last["per_window"]
    print(f"\noverlap / per_window (last micro-step time): {ratio:.2f}")
    print(f"sums: {ranks[0]['per_window']['sum_bytes']} bytes per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
