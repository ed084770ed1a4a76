"""One benchmark, the package at a git revision against the working tree.

    KERAS_BACKEND=jax python -m benchmarks.versus --base ce8c175 \
        [--rounds 2] -- window_steps [--xla] [--windows 50]

Runs `python -m benchmarks.<module> <args>` in turn (base, tree, base,
tree, ...), each in a fresh process that imports `accum_optimizers` from
the revision's files or the working tree's, and the same benchmark code,
the working tree's, for both: only the library differs. Alternating keeps
a drift of the machine's speed from falling on one side. Prints each run's
output, then, for every row of the markdown tables the benchmark printed
(matched by their text cells), the median over rounds of each number on
both sides and the ratio tree / base. With `--relative-to parent`, each
row's numbers are first divided, within its run, by those of the row that
has `parent` in place of one of its text cells (ours / parent in the same
process), so that the ratio compares the two libraries' costs relative to
the same Keras optimizer.
"""

import argparse
import collections
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def _side(workdir, name, package_dir):
    """A folder where `accum_optimizers` is `package_dir` and `benchmarks`
    the working tree's."""
    side = pathlib.Path(workdir) / name
    side.mkdir()
    (side / "accum_optimizers").symlink_to(package_dir)
    (side / "benchmarks").symlink_to(ROOT / "benchmarks")
    return side


def _extract(revision, workdir):
    """The revision's `accum_optimizers/`, extracted under `workdir`."""
    archive = pathlib.Path(workdir) / "base.tar"
    subprocess.run(
        ["git", "archive", "-o", str(archive), revision, "accum_optimizers"],
        cwd=ROOT,
        check=True,
    )
    target = pathlib.Path(workdir) / "base-files"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target / "accum_optimizers"


def _rows(output):
    """{text cells: [numbers]} of the markdown table rows in `output`."""
    rows = {}
    for line in output.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        key = tuple(cell for cell in cells if not NUMBER.match(cell))
        numbers = [float(cell) for cell in cells if NUMBER.match(cell)]
        if numbers:
            rows[key] = numbers
    return rows


def _relative(rows, name):
    """`rows` divided by the row with `name` in place of one text cell."""
    relative = {}
    for key, numbers in rows.items():
        for i in range(len(key)):
            other = key[:i] + (name,) + key[i + 1 :]
            if other != key and other in rows:
                relative[key] = [
                    n / d if d else float("nan")
                    for n, d in zip(numbers, rows[other])
                ]
                break
    return relative


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="a git revision")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--relative-to",
        default=None,
        help="divide each row by the row with this text cell, in its run",
    )
    parser.add_argument("module", help="a module of benchmarks/")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if options.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {options.rounds}")
    runs = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as workdir:
        sides = {
            "base": _side(workdir, "base", _extract(options.base, workdir)),
            "tree": _side(workdir, "tree", ROOT / "accum_optimizers"),
        }
        command = [sys.executable, "-m", f"benchmarks.{options.module}"]
        for round_index in range(options.rounds):
            for name, side in sides.items():
                label = options.base if name == "base" else "the tree"
                print(f"== {label}, round {round_index + 1}", flush=True)
                result = subprocess.run(
                    command + options.args,
                    cwd=side,
                    env=dict(os.environ, PYTHONPATH=str(side)),
                    capture_output=True,
                    text=True,
                )
                print(result.stdout, flush=True)
                if result.returncode:
                    sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
                rows = _rows(result.stdout)
                if options.relative_to:
                    rows = _relative(rows, options.relative_to)
                runs[name].append(rows)
    relative = (
        f"each row / its {options.relative_to} row in the same run; "
        if options.relative_to
        else ""
    )
    print(
        f"{relative}medians over {options.rounds} rounds; ratio = tree / base"
    )
    for key in runs["base"][0]:
        if not all(key in rows for rows in runs["base"] + runs["tree"]):
            continue
        base = [
            statistics.median(c) for c in zip(*(r[key] for r in runs["base"]))
        ]
        tree = [
            statistics.median(c) for c in zip(*(r[key] for r in runs["tree"]))
        ]
        ratios = [t / b if b else float("nan") for t, b in zip(tree, base)]
        print(
            " | ".join(key),
            "| base",
            " ".join(f"{v:.2f}" for v in base),
            "| tree",
            " ".join(f"{v:.2f}" for v in tree),
            "| ratio",
            " ".join(f"{v:.2f}" for v in ratios),
        )


if __name__ == "__main__":
    main()
