"""Ours against Keras' built-in accumulation and the parent, per micro-step,
with the features' cost: one command.

    python -m benchmarks.micro_step [--runs 4] [--repeats 6]
        [--modes tensorflow tensorflow-xla jax torch]
        [--workloads mlp convnet transformer]
        [--out benchmarks/results/micro_step] [--report-only]

Each run is one `benchmarks.worker` process per mode and workload, which
builds Adam in seven configurations from the same initial weights (the
parent, Keras' `gradient_accumulation_steps=4`, ours at `accum_iters=4`
and 1, and ours at 4 with `skip_nonfinite`, `measure_noise_scale` and
both), run N building the N-th of them first (where a model's buffers
lie depends on what was built before it), warms each up, then alternates
them for `--repeats` rounds. Every run's records go to
`OUT/MODE_WORKLOAD_runN.jsonl`; the summary, `OUT/micro_step.md`, gives
each ratio as the median over a run's rounds of the per-round ratio, then
the median of those over the runs and their range. Run it on an otherwise
idle machine (~36 min on 2 cores for the defaults).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.run import MODES as BACKEND_OF_MODE
from benchmarks.run import ROOT

MODES = ["tensorflow", "tensorflow-xla", "jax", "torch"]
CONFIGS = [
    "parent",
    "keras_builtin_k4",
    "ours_k4",
    "ours_k1",
    "ours_k4_skip",
    "ours_k4_noise",
    "ours_k4_skip_noise",
]
# (column, numerator, denominator): above 1 the numerator is faster.
RATIOS = [
    ("ours / Keras' built-in", "ours_k4", "keras_builtin_k4"),
    ("ours / parent", "ours_k4", "parent"),
    ("`accum_iters=1` / parent", "ours_k1", "parent"),
    ("skip / ours", "ours_k4_skip", "ours_k4"),
    ("noise scale / ours", "ours_k4_noise", "ours_k4"),
    ("both / ours", "ours_k4_skip_noise", "ours_k4"),
]


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument(
        "--workloads", nargs="+", default=["mlp", "convnet", "transformer"]
    )
    parser.add_argument("--out", default="benchmarks/results/micro_step")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="summarize the runs already in --out",
    )
    return parser.parse_args(argv)


def run_file(out, mode, workload, run):
    return Path(out) / f"{mode}_{workload}_run{run}.jsonl"


def run_worker(mode, workload, repeats, path, build_shift=0):
    """One worker process, its configurations built in their order rotated
    by `build_shift`; its JSON records into `path`."""
    env = {
        **os.environ,
        "KERAS_BACKEND": BACKEND_OF_MODE[mode],
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    command = [
        sys.executable,
        "-m",
        "benchmarks.worker",
        "--mode",
        mode,
        "--workloads",
        workload,
        "--optimizers",
        "adam",
        "--repeats",
        str(repeats),
        "--configs",
        *CONFIGS,
        "--build-shift",
        str(build_shift),
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True
    )
    records = [line for line in result.stdout.splitlines() if line[:1] == "{"]
    if result.returncode != 0 and not records:
        records = [json.dumps({"error": result.stderr[-300:]})]
    path.write_text("\n".join(records) + "\n")


def ratios_of(path):
    """`{column: median per-round ratio}` of one run's records."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    rounds = {r["config"]: r["repeats"] for r in records if "repeats" in r}
    found = {}
    for column, top, bottom in RATIOS:
        if top in rounds and bottom in rounds:
            found[column] = statistics.median(
                a / b for a, b in zip(rounds[top], rounds[bottom])
            )
    return found


def summary(args):
    """The markdown table: one row per mode and workload, each cell the
    median over runs of the runs' median ratios, and their range."""
    header = "| mode | workload | " + " | ".join(c for c, _, _ in RATIOS)
    lines = [header + " |", "|---" * (len(RATIOS) + 2) + "|"]
    for workload in args.workloads:
        for mode in args.modes:
            runs = [
                ratios_of(path)
                for run in range(1, args.runs + 1)
                if (path := run_file(args.out, mode, workload, run)).exists()
            ]
            cells = []
            for column, _, _ in RATIOS:
                values = sorted(r[column] for r in runs if column in r)
                cells.append(_median_and_range(values))
            lines.append(f"| {mode} | {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _median_and_range(values):
    """`median (low-high)` of sorted `values` to 2 decimals (one figure
    where they round alike), or `n/a`."""
    if not values:
        return "n/a"
    median = f"{statistics.median(values):.2f}"
    low, high = f"{values[0]:.2f}", f"{values[-1]:.2f}"
    return median if low == high else f"{median} ({low}-{high})"


def main(argv=None):
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for run in range(1, args.runs + 1):
            for workload in args.workloads:
                for mode in args.modes:
                    path = run_file(args.out, mode, workload, run)
                    # Each run builds another configuration first, so that
                    # the build order favours none in every run.
                    run_worker(mode, workload, args.repeats, path, run - 1)
                    print(f"run {run}: {mode} {workload}", flush=True)
    table = summary(args)
    (Path(args.out) / "micro_step.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
