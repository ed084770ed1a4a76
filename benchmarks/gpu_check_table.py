"""The GPU check's table (markdown): one row per backend, one column per
figure, a step's status where it has no figure."""

HEADER = (
    "| backend | device | ours k=4 / parent (samples/s) | ours k=4 / "
    "Keras k=4 | memory: extra / sums (bound 1.00) | fit_to_memory "
    "(real out-of-memory errors) | exactness: max abs dw, k=4 at b vs "
    "Adam at 4b |\n|---|---|---|---|---|---|---|"
)


def _ratio(value):
    return "n/a" if value is None else f"{value:.2f}"


def _relative(difference, largest):
    return f"{difference:.1e} ({difference / largest:.1e} of max abs w)"


def device_cell(result):
    if result["status"] != "ok":
        return result["status"]
    return f"{result['device']} ({result['backend_version']})"


def exactness_cell(result):
    if result["status"] != "ok":
        return result["status"]
    return _relative(result["max_abs_difference"], result["largest_weight"])


def speed_cells(result):
    if result["status"] != "ok":
        return [result["status"]] * 2
    return [
        f"{_ratio(result['ours_over_parent'])} ({result['mode']})",
        _ratio(result["ours_over_keras"]),
    ]


def memory_cell(result):
    if result["status"] != "ok":
        return result["status"]
    return f"{result['extra_over_sums']:.2f} ({result['mode']})"


def fit_to_memory_cell(result):
    if result["status"] != "ok":
        return result["status"]
    ours = result["ours"]
    out_of_memory = sum(1 for _, fits, _ in ours["probes"] if not fits)
    cell = (
        f"micro-batch {ours['micro_batch_size']} x {ours['accum_iters']}, "
        f"{out_of_memory} of {len(ours['probes'])} probes out of memory, "
        f"{len(ours['recoveries'])} recoveries"
    )
    if "max_abs_difference" in result:
        difference = _relative(
            result["max_abs_difference"], result["largest_weight"]
        )
        cell += f", vs parent {difference}"
    return cell


def _cell(text):
    return str(text).replace("|", "/").replace("\n", " ")[:200]


def markdown(record):
    """The table of `record` (what `gpu_check.main` writes as JSON), with a
    line saying what ran and how long it took."""
    lines = [HEADER]
    for backend, steps in record["results"].items():
        cells = [
            backend,
            device_cell(steps["device"]),
            *speed_cells(steps["speed"]),
            memory_cell(steps["memory"]),
            fit_to_memory_cell(steps["fit_to_memory"]),
            exactness_cell(steps["device"]),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    mode = "smoke (tiny workloads, not figures)" if record["smoke"] else "full"
    lines.append("")
    lines.append(
        f"`{record['command']}`: {mode}, {record['seconds']:.0f} s of a "
        f"{record['budget_s']:.0f} s budget."
    )
    return "\n".join(lines) + "\n"
