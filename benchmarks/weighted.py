"""What weighing a window's micro-batches costs: one command.

    python -m benchmarks.weighted [--modes tensorflow tensorflow-xla jax torch]
                                  [--rounds 150]
                                  [--out benchmarks/results/weighted] [--smoke]

For every backend mode, one process (`weighted_worker.py`) times, side by
side in interleaved rounds of one window each, `AdamAccumulate` with
`accum_iters=4` on the MLP, with and without weights: in the training step
`model.fit` compiles (weighted by `weigh_micro_batches(model)`; beside it
the parent `Adam` at the same micro-batch) and in a custom training step
compiled as the backend compiles one (`optimizer.apply(grads, vars)`
against `apply(grads, vars, weight=n)`). Writes `results.json` (every
round) and `results.md` (ms per micro-step and the paired ratios) to
`--out`.
`--smoke` runs a few steps of everything, for the tests.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks import run

MODES = ["tensorflow", "tensorflow-xla", "jax", "torch"]
# (column, group, numerator, denominator): ratios of ms per micro-step.
RATIOS = [
    ("fit weighted/unweighted", "fit", "weighted", "unweighted"),
    ("fit unweighted/parent", "fit", "unweighted", "parent"),
    ("loop weighted/unweighted", "loop", "weighted", "unweighted"),
]


def paired_ratio(numerator, denominator):
    """The ratio within a round, where both ran back to back, over rounds:
    `(median, (low, high), (first quartile, third quartile))`, `(low,
    high)` a distribution-free 95% confidence interval of the median."""
    ratios = sorted(a / b for a, b in zip(numerator, denominator))
    count = len(ratios)
    if count < 2:
        return ratios[0], (ratios[0], ratios[0]), (ratios[0], ratios[0])
    first, median, third = statistics.quantiles(ratios, n=4)
    half = 0.98 * math.sqrt(count)  # 1.96 standard deviations of a rank
    low = ratios[max(0, math.floor(count / 2 - half))]
    high = ratios[min(count - 1, math.ceil(count / 2 + half))]
    return median, (low, high), (first, third)


def rows(results):
    """One row per mode: median ms per micro-step and the paired ratios."""
    by_mode = {}
    for record in results["timings"]:
        times = by_mode.setdefault(record["mode"], {})
        times[record["group"], record["config"]] = record
    table = []
    for mode, records in by_mode.items():
        ratios = {
            name: paired_ratio(
                records[group, numerator]["ms_per_step"],
                records[group, denominator]["ms_per_step"],
            )
            for name, group, numerator, denominator in RATIOS
        }
        ms = {
            key: statistics.median(r["ms_per_step"])
            for key, r in records.items()
        }
        checks = {
            key: r.get(
                "total_weight_after_one", r.get("extra_weight_after_one")
            )
            for key, r in records.items()
        }
        table.append(
            {"mode": mode, "ms": ms, "ratios": ratios, "checks": checks}
        )
    return table


def markdown(results):
    lines = [
        "# Weighted windows: benchmark results",
        "",
        f"Command: `{results['command'].strip()}`  ",
        f"Machine: {results['machine']['platform']}, "
        f"{results['machine']['cpu_count']} CPU cores, Python "
        f"{results['machine']['python']}. {results['rounds']} interleaved "
        "rounds after warm-up"
        + (" (SMOKE RUN: not a measurement)" if results["smoke"] else "")
        + f"; {results['seconds']} s in all.",
        "",
        "MLP, micro-batch 32, `AdamAccumulate(accum_iters=4)`. ms per "
        "micro-step (median round; lower is better) and ratios of ms per "
        "micro-step (above 1: the first is slower): the median over rounds "
        "of the ratio within a round (a round times one window of 4 "
        "micro-steps of each configuration, back to back), then its 95% "
        "confidence interval and the interquartile range of the rounds. "
        "`fit`: Keras' `train_step` as `model.fit` compiles it, weighted by "
        "`weigh_micro_batches`; `loop`: a custom step calling "
        "`optimizer.apply`, weighted with `weight=32`. `weight`: the "
        "optimizer's total weight after a window's first micro-batch (32: "
        "the weighted path ran).",
        "",
        "| mode | fit: parent | fit: ours | fit: weighted | loop: ours "
        "| loop: weighted | "
        + " | ".join(name for name, *_ in RATIOS)
        + " | weight (fit, loop) |",
        "|" + "---|" * (7 + len(RATIOS)),
    ]
    for row in rows(results):
        cells = [row["mode"]]
        cells += [
            f"{row['ms'][key]:.2f}"
            for key in (
                ("fit", "parent"),
                ("fit", "unweighted"),
                ("fit", "weighted"),
                ("loop", "unweighted"),
                ("loop", "weighted"),
            )
        ]
        cells += [
            f"**{median:.3f}** ({low:.3f}-{high:.3f}; {first:.2f}-{third:.2f})"
            for median, (low, high), (first, third) in row["ratios"].values()
        ]
        checks = row["checks"]
        cells.append(
            f"{checks['fit', 'weighted']:g}, {checks['loop', 'weighted']:g}"
        )
        lines.append("| " + " | ".join(cells) + " |")
    for failure in results["failures"]:
        lines += [
            "",
            f"Worker failed: {failure['mode']} (exit "
            f"{failure['returncode']}); its row is missing:",
            "",
            "```",
            *failure["stderr_tail"][-6:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument(
        "--out",
        type=Path,
        default=run.ROOT / "benchmarks" / "results" / "weighted",
    )
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    rounds = 1 if args.smoke else args.rounds
    started = time.time()
    results = {
        "command": "python -m benchmarks.weighted "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": run.machine(),
        "rounds": rounds,
        "smoke": args.smoke,
        "seconds": 0,
        "timings": [],
        "failures": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        print(f"timing {mode} ...", flush=True)
        arguments = ["--rounds", str(rounds)] + ["--smoke"] * args.smoke
        records = run._worker(mode, arguments, "benchmarks.weighted_worker")
        run._collect(results, "timings", records)
        results["seconds"] = round(time.time() - started)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.out / "results.md").write_text(text)
    print(text)
    return results


if __name__ == "__main__":
    main()
