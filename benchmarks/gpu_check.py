"""One GPU check of every installed backend: one command.

    python -m benchmarks.gpu_check [--backends tensorflow jax torch]
                                   [--budget-s 480] [--repeats 5]
                                   [--out benchmarks/results/gpu] [--smoke]

Meant for a fresh virtual environment on a machine with one GPU
(`pip install -r requirements/gpu.txt`). For each backend installed, in
processes of its own (Keras reads `KERAS_BACKEND` once per process):

- `device`: what the backend computes on, and exactness: the largest
  weight difference of `AdamAccumulate(accum_iters=4)` at the micro-batch
  b against Keras' `Adam` at 4b after one fit (`benchmarks/exactness.py`,
  float32 matrix products at full precision);
- `speed`: `benchmarks.run`'s worker on the MLP with Adam: samples/s of
  ours (k=4) over the parent and over Keras' `gradient_accumulation_steps=4`
  (paired medians over `--repeats` rounds; TensorFlow under XLA, Keras'
  default for `fit`);
- `memory`: `benchmarks.memory` on its parameter-heavy MLP: ours' peak over
  the parent's, in units of the sums' bytes (the bound is 1.00; TensorFlow
  without XLA, the GPU allocator's peak);
- `fit_to_memory`: `benchmarks/fit_to_memory_gpu.py`: planned by real
  out-of-memory errors under a device-memory cap (torch: the cap halved
  mid-epoch, a real error to recover from), against the parent uncapped.

Steps run kind by kind over the backends (every backend's device check
first), each killed past its share of `--budget-s`; what the budget leaves
no time for is reported as skipped. Prints one table and writes
`gpu_check.json` and `gpu_check.md` to `--out`. Exits with 1 when a step
failed or timed out, or (without `--smoke`) when a backend found no GPU.

`--smoke` runs on a CPU in well under a minute per backend: a few steps of
small models; `fit_to_memory` needs a GPU's out-of-memory errors and is
skipped, as every GPU-only step is, with a 'skipped: no GPU' cell.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import fit_to_memory_gpu
from benchmarks import memory
from benchmarks import report
from benchmarks import run
from benchmarks.gpu_check_table import markdown

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("tensorflow", "jax", "torch")
TIMING_MODES = {"tensorflow": "tensorflow-xla", "jax": "jax", "torch": "torch"}
MEMORY_MODES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
# Steps in the order they run, each with its share of the budget (a weight
# for how long it takes).
STEPS = {"device": 1, "speed": 2, "memory": 2, "fit_to_memory": 3}
NO_GPU = "skipped: no GPU"
NO_TIME = "skipped: time budget spent"


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=None,
        help="default: every installed backend",
    )
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.backends is None:
        args.backends = [
            b for b in BACKENDS if importlib.util.find_spec(b) is not None
        ]
    if args.out is None:
        folder = "gpu-smoke" if args.smoke else "gpu"
        args.out = ROOT / "benchmarks" / "results" / folder
    return args


class Budget:
    """Seconds left of the whole check, shared out by the steps' weights."""

    def __init__(self, seconds, pending_weight):
        self.deadline = time.monotonic() + seconds
        self.pending_weight = pending_weight

    def share(self, weight):
        """Seconds the next step (of `weight`) may take; 0 when none is
        left. Time a step leaves unused goes to the later ones."""
        left = self.deadline - time.monotonic()
        seconds = left * weight / self.pending_weight
        self.pending_weight -= weight
        return max(0.0, seconds)


def device_step(backend, args, timeout):
    """The device and the exactness fit (`benchmarks.exactness`)."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, "-m", "benchmarks.exactness"]
    completed = subprocess.run(
        command + (["--smoke"] if args.smoke else []),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [x for x in completed.stdout.splitlines() if x.startswith("{")]
    if completed.returncode or not lines:
        return {"status": "failed", "error": completed.stderr[-2000:]}
    return {"status": "ok", **json.loads(lines[-1])}


def speed_step(backend, args, timeout):
    """Samples/s ratios from `benchmarks.run`'s worker (MLP, Adam)."""
    mode = TIMING_MODES[backend]
    arguments = ["--workloads", "mlp", "--optimizers", "adam"]
    arguments += ["--configs", "parent", "keras_builtin_k4", "ours_k4"]
    arguments += ["--repeats", str(1 if args.smoke else args.repeats)]
    records = run._worker(
        mode, arguments + (["--smoke"] if args.smoke else []), timeout=timeout
    )
    failures = [r for r in records if "failed" in r or "error" in r]
    if failures:
        return {"status": "failed", "mode": mode, "error": failures}
    (row,) = report.ratio_rows({"timings": records})
    return {
        "status": "ok",
        "mode": mode,
        "samples_per_s": row["rates"],
        "ours_over_parent": row["ratios"]["ours4/parent"],
        "ours_over_keras": row["ratios"]["ours4/keras"],
    }


def memory_step(backend, args, timeout):
    """`extra / sums` of ours from `benchmarks.memory` (MLP)."""
    mode = MEMORY_MODES[backend]
    options = ["--workloads", "mlp", "--configs", "parent", "ours_k4"]
    options += ["--smoke"] if args.smoke else []
    records = memory.run_mode(
        mode, memory.worker_arguments(memory.parse(options)), timeout
    )
    errors = [r for r in records if "error" in r]
    by_config = {r["config"]: r for r in records if "config" in r}
    if errors or set(by_config) != {"parent", "ours_k4"}:
        return {"status": "failed", "mode": mode, "error": errors or records}
    parent, ours = by_config["parent"], by_config["ours_k4"]
    return {
        "status": "ok",
        "mode": mode,
        "peak_bytes": {
            "parent": parent["peak_bytes"],
            "ours_k4": ours["peak_bytes"],
        },
        "sums_bytes": ours["sums_bytes"],
        "extra_over_sums": (ours["peak_bytes"] - parent["peak_bytes"])
        / ours["sums_bytes"],
    }


def fit_to_memory_step(backend, args, timeout):
    """`benchmarks/fit_to_memory_gpu.py` on `backend`, its defaults, the
    torch cap halved after 6 micro-steps."""
    options = fit_to_memory_gpu.parse(["--squeeze-after", "6"])
    row = fit_to_memory_gpu.check_backend(backend, options, timeout)
    failed = any("error" in row[run_] for run_ in ("ours", "parent"))
    return {"status": "failed" if failed else "ok", **row}


RUNNERS = {
    "device": device_step,
    "speed": speed_step,
    "memory": memory_step,
    "fit_to_memory": fit_to_memory_step,
}


def skipped_because(step, backend, results, args):
    """Why `step` does not run on `backend`, or `None` if it runs."""
    found = results[backend].get("device", {})
    if step == "device":
        return None
    if found.get("status") != "ok":
        return "skipped: the device check failed"
    if not found["gpu"] and not args.smoke:
        return NO_GPU
    if step == "fit_to_memory":
        return NO_GPU if not found["gpu"] else "skipped: --smoke"
    return None


def check(args):
    """Runs every step on every backend; returns the results."""
    results = {backend: {} for backend in args.backends}
    budget = Budget(args.budget_s, sum(STEPS.values()) * len(args.backends))
    for step, weight in STEPS.items():
        for backend in args.backends:
            timeout = budget.share(weight)
            reason = skipped_because(step, backend, results, args)
            if reason is None and timeout < 1:
                reason = NO_TIME
            if reason is not None:
                results[backend][step] = {"status": reason}
                continue
            print(f"{step} on {backend} (at most {timeout:.0f} s)", flush=True)
            started = time.monotonic()
            try:
                result = RUNNERS[step](backend, args, timeout)
            except subprocess.TimeoutExpired:
                result = {"status": f"timed out after {timeout:.0f} s"}
            result["seconds"] = round(time.monotonic() - started, 1)
            results[backend][step] = result
    return results


def succeeded(results, args):
    """No step failed or timed out, and (for a real check) every backend
    computed on a GPU."""
    for steps in results.values():
        for result in steps.values():
            status = result["status"]
            if status == "failed" or status.startswith("timed out"):
                return False
            if status == NO_GPU and not args.smoke:
                return False
    return True


def main(argv=None):
    args = parse(argv)
    if not args.backends:
        print("no Keras backend is installed", file=sys.stderr)
        return 1
    started = time.monotonic()
    results = check(args)
    record = {
        "command": "python -m benchmarks.gpu_check "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": run.machine(),
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "seconds": round(time.monotonic() - started, 1),
        "results": results,
    }
    table = markdown(record)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(record, indent=1))
    (args.out / "gpu_check.md").write_text(table)
    print(f"written to {args.out}")
    return 0 if succeeded(results, args) else 1


if __name__ == "__main__":
    sys.exit(main())
