"""Runs the suite's core on older and newer Keras: the compatibility legs.

    python scripts/run_compat.py [--legs NAME ...] [--jobs 2] [--venvs DIR]
                                 [--install-only] [--list]

    python scripts/run_compat.py --legs keras3.10-jax     # one leg

Each leg is a Keras and a backend, pinned in `requirements/compat-<leg>.txt`.
A leg gets its own virtual environment (`<venvs>/<leg>`, made once and
reused while its pinned file is unchanged) that installs only from that
file; the package itself is then installed from this checkout with
`--no-deps`, and `pip check` proves the pinned Keras satisfies its
requirements (keras-nightly installs `keras` under another name, so that
leg skips the check). The leg then runs the core of the suite (`CORE`
below: exactness against the big batch, every optimizer, saving and
resuming, reliability, weighted windows, schedules, the private Keras APIs
and the supported versions) with `scripts/run_tests.py` on its backend,
with hypothesis' `compat` profile (4 derandomized examples;
`HYPOTHESIS_PROFILE` overrides it), its output in `<venvs>/<leg>.log`.
`<venvs>` defaults to `.venv-compat/` in the checkout (ignored by git). Legs
run `--jobs` at a time. One line per leg, then the total:
`compat: N passed, N failed, N skipped`.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# leg -> Keras backend; each reads requirements/compat-<leg>.txt. Slowest
# first (TensorFlow takes about as long as the two JAX legs together), so
# that two at a time end together.
LEGS = {
    "keras3.13-tf2.20": "tensorflow",
    "keras-nightly-jax": "jax",
    "keras3.10-jax": "jax",
    "keras3.13-torch": "torch",
}

# The core of the suite that every leg runs.
CORE = [
    "tests/test_versions.py",
    "tests/test_keras_private.py",
    "tests/test_equivalence.py",
    "tests/test_every_optimizer.py",
    "tests/test_saving.py",
    "tests/test_reliability.py",
    "tests/test_window_state.py",
    "tests/test_window_features.py",
    "tests/test_weighted_windows.py",
    "tests/test_schedules.py",
]

# Left out of the legs: fit on hypothesis-drawn data (the slowest test of the
# core), which the weighted windows' named cases cover one by one.
DESELECT = "not test_fit_on_drawn_data_equals_the_big_batch"

# The closing line of scripts/run_tests.py.
_TOTAL = re.compile(r"^tests: (\d+) passed, (\d+) failed, (\d+) skipped$")


def requirements(leg):
    return ROOT / "requirements" / f"compat-{leg}.txt"


def _python(venv):
    return venv / "bin" / "python"


def install(leg, venvs, log):
    """Makes (or reuses) the leg's venv; returns its python."""
    venv = venvs / leg
    pinned = requirements(leg).read_bytes()
    stamp = venv / "compat-requirements.sha256"
    digest = hashlib.sha256(pinned).hexdigest()
    python = _python(venv)

    def run(*command):
        log.write(f"$ {' '.join(map(str, command))}\n")
        log.flush()
        subprocess.run(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True
        )

    if not (stamp.exists() and stamp.read_text() == digest):
        run(sys.executable, "-m", "venv", "--clear", venv)
        run(python, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
        run(python, "-m", "pip", "install", "--quiet", "-r", requirements(leg))
        stamp.write_text(digest)
    run(python, "-m", "pip", "install", "--quiet", "--no-deps", "-e", ".")
    if "nightly" not in leg:
        run(python, "-m", "pip", "check")
    return python


def run_leg(leg, venvs, install_only=False):
    """Installs and runs one leg: `(counts or None, seconds, log path)`."""
    log_path = venvs / f"{leg}.log"
    start = time.perf_counter()
    counts = None
    with open(log_path, "w") as log:
        try:
            python = install(leg, venvs, log)
        except subprocess.CalledProcessError as error:
            log.write(f"install failed: {error}\n")
            return counts, time.perf_counter() - start, log_path
        if install_only:
            return {"installed": True}, time.perf_counter() - start, log_path
        command = [
            python,
            "scripts/run_tests.py",
            "--backends",
            LEGS[leg],
            "--",
            *CORE,
            "-q",
            "-k",
            DESELECT,
        ]
        log.write(f"$ {' '.join(map(str, command))}\n")
        log.flush()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        env.setdefault("HYPOTHESIS_PROFILE", "compat")
        env.pop("KERAS_BACKEND", None)
        output = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ).stdout
        log.write(output)
    for line in output.splitlines():
        match = _TOTAL.match(line.strip())
        if match:
            passed, failed, skipped = map(int, match.groups())
            counts = {"passed": passed, "failed": failed, "skipped": skipped}
    return counts, time.perf_counter() - start, log_path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--legs", nargs="+", choices=list(LEGS), default=list(LEGS)
    )
    parser.add_argument(
        "--jobs", type=int, default=2, help="legs run at once (default 2)"
    )
    parser.add_argument(
        "--venvs",
        type=Path,
        default=ROOT / ".venv-compat",
        help="folder of the legs' venvs and logs (default: .venv-compat)",
    )
    parser.add_argument(
        "--install-only",
        action="store_true",
        help="make the legs' venvs and stop (CI does it while the main "
        "suite runs)",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the legs and the core"
    )
    args = parser.parse_args(argv)
    if args.list:
        for leg, backend in LEGS.items():
            print(f"{leg:<18} {backend:<11} {requirements(leg).name}")
        print("core:", " ".join(CORE))
        return 0
    venvs = args.venvs.resolve()
    venvs.mkdir(parents=True, exist_ok=True)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {
            leg: pool.submit(run_leg, leg, venvs, args.install_only)
            for leg in args.legs
        }
        results = {leg: future.result() for leg, future in futures.items()}

    print("\n=== compatibility legs")
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    ok = True
    for leg, (counts, seconds, log_path) in results.items():
        if counts is None:
            ok = False
            totals["failed"] += 1
            print(f"{leg:<18} FAILED (install or run), see {log_path}")
            continue
        if args.install_only:
            print(f"{leg:<18} installed in {seconds:.0f} s")
            continue
        for key in totals:
            totals[key] += counts[key]
        ok = ok and counts["failed"] == 0 and counts["passed"] > 0
        print(
            f"{leg:<18} {counts['passed']} passed, {counts['failed']} "
            f"failed, {counts['skipped']} skipped in {seconds:.0f} s "
            f"({log_path.name})"
        )
    if not ok:
        for counts, _, log_path in results.values():
            if counts is None or counts.get("failed"):
                print(f"\n--- last lines of {log_path}")
                lines = log_path.read_text().splitlines()
                print("\n".join(lines[-40:]))
    if not args.install_only:
        print(
            f"compat: {totals['passed']} passed, {totals['failed']} failed, "
            f"{totals['skipped']} skipped"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
