"""Turns benchmark records into the ratio table (markdown) and a chart."""

import statistics
from collections import defaultdict

# (name, numerator, denominator, bar): the ratios the project promises.
RATIOS = [
    ("ours4/parent", "ours_k4", "parent", 1.0),
    ("ours4/keras", "ours_k4", "keras_builtin_k4", 1.0),
    ("ours4/ceiling", "ours_k4", "ceiling", 0.9),
    ("ours1/parent", "ours_k1", "parent", 0.95),
]
BARS_ON_JAX = {"ours4/keras": 1.5}
COLUMNS = [
    ("parent", "parent b"),
    ("keras_builtin_k4", "Keras k=4"),
    ("ours_k4", "ours k=4"),
    ("ours_k1", "ours k=1"),
    ("ceiling", "ceiling"),
    ("parent_4b", "parent 4b"),
]
COUNTER_BYTES = 16  # two scalar counters (int32 or int64)


def attainable(seconds, name):
    """The largest value ratio `name` can take for any accumulating optimizer.

    A micro-step that accumulates costs at least the ceiling's step
    (forward + backward + one add), and the window's last one at least the
    parent's step (forward + backward + the update), so no window of 4
    micro-batches runs faster than `3 * ceiling + parent`. `seconds` maps
    each configuration to its seconds per micro-batch in one round.
    Returns `None` for a ratio whose numerator is not ours(k=4)
    (`ours1/parent` runs the parent's own code: 1.0 up to the run's
    resolution) or when a configuration is missing.
    """
    numerator, denominator = next(
        (numerator, denominator)
        for ratio, numerator, denominator, _ in RATIOS
        if ratio == name
    )
    needed = {"ceiling", "parent", denominator}
    if numerator != "ours_k4" or not needed <= set(seconds):
        return None
    fastest_window = 3 * seconds["ceiling"] + seconds["parent"]
    return 4 * seconds[denominator] / fastest_window


def _groups(results):
    groups = defaultdict(dict)
    for record in results["timings"]:
        key = (record["mode"], record["workload"], record["optimizer"])
        groups[key][record["config"]] = record
    return groups


def ratio_rows(results, statistic="paired"):
    """One row per (mode, workload, optimizer): rates, ratios, verdicts.

    `rates` are each configuration's median samples/s. `statistic` says how
    a ratio is taken: `"paired"` (the headline) is the median over rounds
    of the ratio within a round, where every configuration ran back to back,
    so a drift that outlasts a round (torch's speed drifts within a
    process) cancels, where a ratio of two medians depends on how many slow
    rounds each configuration drew. `"best"` is
    the ratio of each configuration's fastest round (the uncontended cost).
    A configuration that raised has no rate and its error in `errors`; a
    ratio over a missing or failed configuration is `None`. `bounds` holds,
    per ratio where it applies, its `attainable` value, taken the same way.
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
        ratios = {}
        bounds = {}
        for name, numerator, denominator, bar in RATIOS:
            if mode.startswith("jax"):
                bar = BARS_ON_JAX.get(name, bar)
            if numerator not in rates or denominator not in rates:
                ratios[name] = None
                continue
            if statistic == "paired":
                value = statistics.median(
                    n / d
                    for n, d in zip(rounds[numerator], rounds[denominator])
                )
                per_round = [
                    attainable({c: 1 / r[i] for c, r in rounds.items()}, name)
                    for i in range(len(rounds[numerator]))
                ]
            else:
                value = max(rounds[numerator]) / max(rounds[denominator])
                per_round = [
                    attainable({c: 1 / max(r) for c, r in rounds.items()}, name)
                ]
            ratios[name] = (value, bar, value >= bar)
            if None not in per_round:
                bounds[name] = statistics.median(per_round)
        extra = (
            records["ours_k4"]["state_bytes"] - records["parent"]["state_bytes"]
        )
        accumulators = records["ours_k4"]["trainable_bytes"]
        state_ok = 0 <= extra - accumulators <= COUNTER_BYTES
        rows.append(
            {
                "mode": mode,
                "workload": workload,
                "optimizer": optimizer,
                "rates": rates,
                "errors": errors,
                "ratios": ratios,
                "bounds": bounds,
                "extra_state_bytes": extra,
                "accumulator_bytes": accumulators,
                "state_ok": state_ok,
            }
        )
    return rows


def memory_rows(results):
    peaks = defaultdict(dict)
    for record in results["memory"]:
        key = (record["mode"], record["workload"])
        peaks[key][record["config"]] = record["peak_rss_bytes"]
    accumulators = {
        (r["mode"], r["workload"]): r["trainable_bytes"]
        for r in results["timings"]
        if r["config"] == "ours_k4" and r["optimizer"] == "adam"
    }
    rows = []
    for (mode, workload), peak in peaks.items():
        row = {"mode": mode, "workload": workload, "peaks": peak}
        if {"parent", "ours_k4"} <= set(peak):
            bound = (peak["parent"] + accumulators[(mode, workload)]) * 1.10
            row["within_bound"] = peak["ours_k4"] <= bound
        if workload == "convnet" and {"parent_4b", "ours_k4"} <= set(peak):
            row["below_parent_4b"] = peak["ours_k4"] < peak["parent_4b"]
        rows.append(row)
    return rows


def _rate_cell(row, config):
    if config in row["rates"]:
        return f"{row['rates'][config]:.0f}"
    if config in row["errors"]:
        return "fails: " + row["errors"][config].split(":")[0]
    return "-"


def _ratio_cells(row, misses):
    """The row's ratio cells; appends each ratio below its bar to `misses`."""
    cells = []
    for name, ratio in row["ratios"].items():
        if ratio is None:
            cells.append("-")
            continue
        value, bar, ok = ratio
        cells.append(f"{value:.2f} ({bar}) {'' if ok else '**NO**'}")
        if not ok:
            misses.append((row, name, value, bar, row["bounds"].get(name)))
    return cells


def _miss_table(title, misses):
    """Each ratio below its bar, beside what any accumulation could reach."""
    lines = [
        "",
        f"{title}: {len(misses)} ratios below their bar. `attainable`: the "
        "value for a method whose micro-steps cost the ceiling's step and "
        "whose window's last step costs the parent's (`attainable` in "
        "`benchmarks/report.py`); below the bar, no accumulating optimizer "
        "meets the bar in this run.",
        "",
        "| mode | workload | optimizer | ratio | value | bar | attainable "
        "| value / attainable |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, name, value, bar, bound in misses:
        if bound is None:
            attained = "-"
            bound_cell = "-"
        else:
            attained = f"{value / bound:.2f}"
            bound_cell = f"{bound:.2f}" + (" (< bar)" if bound < bar else "")
        lines.append(
            f"| {row['mode']} | {row['workload']} | {row['optimizer']} | "
            f"{name} | {value:.3f} | {bar} | {bound_cell} | {attained} |"
        )
    return lines


def _mark(ok):
    return "yes" if ok else "**NO**"


def markdown(results):
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
        "Micro-batch samples/s (median round; higher is better) and the "
        "promised ratios, each the median over rounds of the ratio within "
        "a round (bar in brackets; `ours4/keras` needs 1.5 on JAX). "
        "`state` checks "
        "that ours(k=4) holds the parent's optimizer state plus exactly one "
        "accumulator per trainable variable (and two scalar counters). "
        "The 2-replica modes count samples of the global micro-batch (2b); "
        "`fails` names the error a configuration raised.",
        "",
    ]
    header = ["mode", "workload", "optimizer"] + [t for _, t in COLUMNS]
    header += [name for name, *_ in RATIOS] + ["state"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    failures = []
    misses = []
    for row in ratio_rows(results):
        cells = [row["mode"], row["workload"], row["optimizer"]]
        cells += [_rate_cell(row, c) for c, _ in COLUMNS]
        cells += _ratio_cells(row, misses)
        cells.append(_mark(row["state_ok"]))
        if not row["state_ok"]:
            failures.append(f"{row['mode']} {row['workload']}: state bytes")
        lines.append("| " + " | ".join(cells) + " |")

    best_misses = []
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
        cells += _ratio_cells(row, best_misses)
        lines.append("| " + " | ".join(cells) + " |")

    memory = memory_rows(results)
    if memory:
        lines += [
            "",
            "Process peak RSS in MiB (Adam; one fresh process per "
            "configuration). `bound`: ours(k=4) <= (parent at b + "
            "accumulators) * 1.10; `< parent 4b`: conv net only.",
            "",
            "| mode | workload | parent b | Keras k=4 | ours k=4 | parent 4b "
            "| bound | < parent 4b |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in memory:
            peaks = row["peaks"]
            mib = [
                f"{peaks[c] / 2**20:.0f}" if c in peaks else "-"
                for c in ("parent", "keras_builtin_k4", "ours_k4", "parent_4b")
            ]
            bound = _mark(row["within_bound"]) if "within_bound" in row else "-"
            below = (
                _mark(row["below_parent_4b"])
                if "below_parent_4b" in row
                else "-"
            )
            for key in ("within_bound", "below_parent_4b"):
                if row.get(key) is False:
                    failures.append(f"{row['mode']} {row['workload']}: {key}")
            lines.append(
                f"| {row['mode']} | {row['workload']} | "
                + " | ".join(mib)
                + f" | {bound} | {below} |"
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
    lines += _miss_table("Medians of paired rounds", misses)
    lines += _miss_table("Fastest rounds", best_misses)
    lines += ["", f"Other checks not met: {len(failures)}"]
    lines += [f"- {failure}" for failure in failures]
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
        ("ceiling", "ceiling"),
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
