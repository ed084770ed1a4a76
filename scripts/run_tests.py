"""Runs the whole test suite once per Keras backend, each in its own process.

    python scripts/run_tests.py [--backends tensorflow jax torch] [--jobs N]
                                [pytest args]

Keras reads `KERAS_BACKEND` at import, so a process holds one backend. The
backends run `--jobs` at a time (default: one per CPU core), the slowest
(TensorFlow) first: a pytest process keeps about one core busy. With more
than one at a time, each backend's output is printed whole when it ends.
Each backend's pytest run is reported on its own line; a backend that is not
installed is reported as SKIPPED (and makes the run fail unless
`--allow-missing` is given), never as passed. The last line is the total:
`tests: N passed, N failed, N skipped`.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


def run_backend(backend, pytest_args, streamed=True):
    """Runs pytest on one backend: `(counts, seconds)`. Not `streamed`, its
    output is printed whole when it ends (backends running side by side)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = dict(os.environ, KERAS_BACKEND=backend)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            *pytest_args,
        ]
        header = f"\n=== {backend}: {' '.join(command[1:])}"
        start = time.perf_counter()
        if streamed:
            print(header, flush=True)
            code = subprocess.call(command, cwd=ROOT, env=env)
        else:
            print(f"=== {backend}: started", flush=True)
            log = Path(tmp) / "output.log"
            with open(log, "w") as output:
                code = subprocess.call(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                )
            print(header, flush=True)
            sys.stdout.write(log.read_text(errors="replace"))
            sys.stdout.flush()
        seconds = time.perf_counter() - start
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        if report.exists():
            suite = ElementTree.parse(report).getroot()
            suite = suite if suite.tag == "testsuite" else suite[0]
            total = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            counts = {
                "passed": total - failed - skipped,
                "failed": failed,
                "skipped": skipped,
            }
        if code not in (0, 5) and counts["failed"] == 0:
            counts["failed"] = 1  # pytest itself failed (collection, crash)
        return counts, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS)
    )
    parser.add_argument(
        "--allow-missing",
        action="store_true",
        help="do not fail when a backend is not installed",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=os.cpu_count() or 1,
        help="backends run at a time (default: the number of CPU cores)",
    )
    args, pytest_args = parser.parse_known_args(argv)

    results = dict.fromkeys(args.backends)  # None: not installed
    installed = []
    for backend in args.backends:
        if importlib.util.find_spec(BACKENDS[backend]) is None:
            print(f"\n=== {backend}: SKIPPED, NOT INSTALLED", flush=True)
        else:
            installed.append(backend)
    jobs = min(args.jobs, len(installed)) or 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running = {
            pool.submit(
                run_backend, backend, pytest_args or ["tests"], jobs == 1
            ): backend
            for backend in installed
        }
        for done in as_completed(running):
            results[running[done]] = done.result()

    print("\n=== summary per backend")
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    missing = []
    for backend, result in results.items():
        if result is None:
            missing.append(backend)
            print(f"{backend:<11} SKIPPED: backend not installed")
            continue
        counts, seconds = result
        for key in totals:
            totals[key] += counts[key]
        print(
            f"{backend:<11} {counts['passed']} passed, {counts['failed']} "
            f"failed, {counts['skipped']} skipped in {seconds:.0f} s"
        )
    ok = totals["failed"] == 0 and (args.allow_missing or not missing)
    if missing:
        print(f"MISSING BACKENDS: {', '.join(missing)}")
    print(
        f"tests: {totals['passed']} passed, {totals['failed']} failed, "
        f"{totals['skipped']} skipped"
    )
    return 0 if ok else 1


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = text
    if not isinstance(value, int) or value < 1:
        raise argparse.ArgumentTypeError(
            f"--jobs must be an integer >= 1, got {value!r}"
        )
    return value


if __name__ == "__main__":
    sys.exit(main())
