"""Turns benchmark records into the ratio table (markdown) and a chart."""

import statistics
from collections import defaultdict

# (name, numerator, denominator): the ratios of samples/s reported.
RATIOS = [
    ("ours4/parent", "ours_k4", "parent"),
    ("ours4/keras", "ours_k4", "keras_builtin_k4"),
    ("ours4/ideal", "ours_k4", "ideal"),
    ("ours1/parent", "ours_k1", "parent"),
]
COLUMNS = [
    ("parent", "parent b"),
    ("keras_builtin_k4", "Keras k=4"),
    ("ours_k4", "ours k=4"),
    ("ours_k1", "ours k=1"),
    ("ceiling", "add-only"),
    ("parent_4b", "parent 4b"),
]
# The window's state beside the sums (`WINDOW_STATE` in
# `accum_optimizers/_window/spec.py`, without the noise scale's, which the
# benchmarks do not measure): its scalars, at most 8 bytes each, and
# one int32 flag per trainable variable (received gradient in the window).
WINDOW_SCALARS = 10
WINDOW_SCALAR_BYTES = 8 * WINDOW_SCALARS
MASK_BYTES = 4
K = 4


def ideal_seconds(seconds):
    """Seconds per micro-batch of an accumulator with no cost of its own.

    A micro-step that only accumulates costs at least the add-only
    configuration's step (forward + backward + one add), and the window's
    last one at least the parent's step (forward + backward + the update),
    so no window of `K` micro-batches runs faster than
    `(K - 1) * ceiling + parent`. `seconds` maps each configuration to its
    seconds per micro-batch in one round. Returns `None` when the ceiling
    or the parent is missing.
    """
    if not {"ceiling", "parent"} <= set(seconds):
        return None
    return ((K - 1) * seconds["ceiling"] + seconds["parent"]) / K


def _groups(results):
    groups = defaultdict(dict)
    for record in results["timings"]:
        key = (record["mode"], record["workload"], record["optimizer"])
        groups[key][record["config"]] = record
    return groups


def _ratio(seconds, numerator, denominator):
    """Samples/s of `numerator` over `denominator`, or `None`."""
    if denominator == "ideal":
        ideal = ideal_seconds(seconds)
        if ideal is None or numerator not in seconds:
            return None
        return ideal / seconds[numerator]
    if numerator not in seconds or denominator not in seconds:
        return None
    return seconds[denominator] / seconds[numerator]


def ratio_rows(results, statistic="paired"):
    """One row per (mode, workload, optimizer): rates and ratios.

    `rates` are each configuration's median samples/s. `statistic` says how
    a ratio is taken: `"paired"` (the headline) is the median over rounds
    of the ratio within a round, where every configuration ran back to back,
    so a drift of the machine's speed that outlasts a round cancels.
    `"best"` is the ratio of each configuration's fastest round (the cost
    with the least interference). A configuration that raised has no rate
    and its error in `errors`; a ratio over a missing or failed
    configuration is `None`.
    """
    rows = []
    for (mode, workload, optimizer), records in _groups(results).items():
        rates = {
            c: r["samples_per_s"]
            for c, r in records.items()
            if "samples_per_s" in r
        }
        rounds = {c: records[c]["repeats"] for c in rates}
        errors = {c: r["error"] for c, r in records.items() if "error" in r}
        if statistic == "paired":
            count = min(len(r) for r in rounds.values())
            per_round = [
                {c: 1 / r[i] for c, r in rounds.items()} for i in range(count)
            ]
        else:
            per_round = [{c: 1 / max(r) for c, r in rounds.items()}]
        ratios = {}
        for name, numerator, denominator in RATIOS:
            values = [_ratio(s, numerator, denominator) for s in per_round]
            ratios[name] = None if None in values else statistics.median(values)
        extra = (
            records["ours_k4"]["state_bytes"] - records["parent"]["state_bytes"]
        )
        accumulators = records["ours_k4"]["trainable_bytes"]
        window = WINDOW_SCALAR_BYTES + MASK_BYTES * records["ours_k4"].get(
            "trainable_count", 0
        )
        state_ok = 0 <= extra - accumulators <= window
        rows.append(
            {
                "mode": mode,
                "workload": workload,
                "optimizer": optimizer,
                "rates": rates,
                "errors": errors,
                "ratios": ratios,
                "extra_state_bytes": extra,
                "accumulator_bytes": accumulators,
                "state_ok": state_ok,
            }
        )
    return rows


def memory_rows(results):
    """One row per (mode, workload): peak RSS per configuration, in bytes."""
    peaks = defaultdict(dict)
    for record in results["memory"]:
        key = (record["mode"], record["workload"])
        peaks[key][record["config"]] = record["peak_rss_bytes"]
    accumulators = {
        (r["mode"], r["workload"]): r["trainable_bytes"]
        for r in results["timings"]
        if r["config"] == "ours_k4" and r["optimizer"] == "adam"
    }
    return [
        {
            "mode": mode,
            "workload": workload,
            "peaks": peak,
            "accumulator_bytes": accumulators.get((mode, workload)),
        }
        for (mode, workload), peak in peaks.items()
    ]


def _rate_cell(row, config):
    if config in row["rates"]:
        return f"{row['rates'][config]:.0f}"
    if config in row["errors"]:
        return "fails: " + row["errors"][config].split(":")[0]
    return "-"


def _ratio_cells(row):
    return [
        "-" if value is None else f"{value:.2f}"
        for value in row["ratios"].values()
    ]


def _mib(value):
    return "-" if value is None else f"{value / 2**20:.0f}"


def markdown(results):
    """The results as a markdown page: rates, ratios, memory, failures."""
    machine = results["machine"]
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{results['command'].strip()}`  ",
        f"Machine: {machine['platform']}, {machine['cpu_count']} CPU cores, "
        f"Python {machine['python']}. {results['repeats']} interleaved "
        "rounds after warm-up (each round runs every configuration once, "
        "back to back, in an order that rotates)"
        + (" (SMOKE RUN: not a measurement)" if results["smoke"] else "")
        + f"; {results['seconds']} s in all.",
        "",
        "Micro-batch samples/s (median round; higher is better), and ratios "
        "of samples/s, each the median over rounds of the ratio within a "
        "round (above 1: the first is faster). `ideal`: an accumulating "
        "optimizer with no cost of its own, whose accumulating micro-steps "
        "cost the add-only step and whose window's last step costs the "
        "parent's (`ideal_seconds` in `benchmarks/report.py`). `state`: "
        "ours(k=4) holds the parent's optimizer state plus exactly one "
        "accumulator per trainable variable (and the window's "
        f"{WINDOW_SCALARS} scalars and a 4-byte flag per variable). The "
        "2-replica modes count samples of the global micro-batch (2b); "
        "`fails` names the error a configuration raised.",
        "",
    ]
    header = ["mode", "workload", "optimizer"] + [t for _, t in COLUMNS]
    header += [name for name, *_ in RATIOS] + ["state"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in ratio_rows(results):
        cells = [row["mode"], row["workload"], row["optimizer"]]
        cells += [_rate_cell(row, c) for c, _ in COLUMNS]
        cells += _ratio_cells(row)
        cells.append("yes" if row["state_ok"] else "no")
        lines.append("| " + " | ".join(cells) + " |")

    lines += [
        "",
        "The same ratios on each configuration's fastest round (the cost "
        "with the least interference):",
        "",
        "| mode | workload | optimizer | "
        + " | ".join(name for name, *_ in RATIOS)
        + " |",
        "|" + "---|" * (3 + len(RATIOS)),
    ]
    for row in ratio_rows(results, statistic="best"):
        cells = [row["mode"], row["workload"], row["optimizer"]]
        cells += _ratio_cells(row)
        lines.append("| " + " | ".join(cells) + " |")

    memory = memory_rows(results)
    if memory:
        lines += [
            "",
            "Process peak RSS in MiB (Adam; one fresh process per "
            "configuration), and the size of ours' accumulators:",
            "",
            "| mode | workload | parent b | Keras k=4 | ours k=4 | parent 4b "
            "| accumulators |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in memory:
            peaks = row["peaks"]
            cells = [
                _mib(peaks.get(c))
                for c in ("parent", "keras_builtin_k4", "ours_k4", "parent_4b")
            ]
            cells.append(_mib(row["accumulator_bytes"]))
            lines.append(
                f"| {row['mode']} | {row['workload']} | "
                + " | ".join(cells)
                + " |"
            )
    for failure in results.get("failures", []):
        lines += [
            "",
            f"Worker failed: {failure['mode']} {failure['failed']} "
            f"(exit {failure['returncode']}); its rows are missing:",
            "",
            "```",
            *failure["stderr_tail"][-6:],
            "```",
        ]
    return "\n".join(lines) + "\n"


def chart(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ratio_rows(results)
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    shown = [
        ("keras_builtin_k4", "Keras k=4"),
        ("ours_k4", "ours k=4"),
        ("ours_k1", "ours k=1"),
        ("ceiling", "add-only"),
    ]
    figure, axes = plt.subplots(
        len(modes), 1, figsize=(11, 2.8 * len(modes)), squeeze=False
    )
    for axis, mode in zip(axes[:, 0], modes):
        mode_rows = [row for row in rows if row["mode"] == mode]
        labels = [f"{r['workload']}\n{r['optimizer']}" for r in mode_rows]
        width = 0.8 / len(shown)
        for i, (config, label) in enumerate(shown):
            values = [
                r["rates"].get(config, float("nan")) / r["rates"]["parent"]
                for r in mode_rows
            ]
            axis.bar(
                [x + i * width for x in range(len(mode_rows))],
                values,
                width,
                label=label,
            )
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(mode_rows))], labels
        )
        axis.set_ylabel("samples/s vs parent")
        axis.set_title(mode)
        axis.tick_params(axis="x", labelsize=7)
    axes[0, 0].legend(ncol=len(shown), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
