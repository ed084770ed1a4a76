"""Side-by-side benchmark of accumulating optimizers: one command.

    python -m benchmarks.run [--modes tensorflow tensorflow-xla jax torch
                              tensorflow-mirrored jax-dataparallel]
                             [--optimizers adam adamw ...] [--workloads mlp ...]
                             [--repeats 5] [--out benchmarks/results] [--smoke]

For every backend mode (TensorFlow without and with XLA, JAX, torch, and on 2
replicas TensorFlow's MirroredStrategy and JAX's DataParallel, MLP only), one
worker process times, side by side, every configuration of every workload and
optimizer (see `worker.py`): warm-up, then `--repeats` interleaved rounds,
medians. Fresh processes then measure the peak RSS of the memory-relevant
configurations (Adam). Writes `results.json` (every round of every
configuration), `results.md` (samples/s, ratios, memory) and `results.png`
(samples/s relative to the parent) to `--out`.
`--smoke` runs a few steps of everything on the given modes, for the tests.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "tensorflow": "tensorflow",
    "tensorflow-xla": "tensorflow",
    "jax": "jax",
    "torch": "torch",
    "tensorflow-mirrored": "tensorflow",
    "jax-dataparallel": "jax",
}
# 2-replica modes: timed on the MLP only, no memory runs (see worker.py).
DISTRIBUTED_MODES = ("tensorflow-mirrored", "jax-dataparallel")
# jax-dataparallel is not run by default: on a 2-core host, XLA's CPU
# all-reduce between 2 emulated devices can deadlock when several compiled
# MLP models share the process (a rendezvous timeout aborts it).
DEFAULT_MODES = [mode for mode in MODES if mode != "jax-dataparallel"]
MEMORY_CONFIGS = ["parent", "keras_builtin_k4", "ours_k4", "parent_4b"]
MEMORY_WORKLOADS = ["mlp", "convnet", "transformer"]


def _worker(mode, arguments, module="benchmarks.worker", timeout=None):
    """Runs one worker process (`module`, a `worker.py` by default) for
    `mode`, killed after `timeout` seconds (`subprocess.TimeoutExpired`);
    returns the JSON records it printed, and one error record if it
    failed."""
    env = dict(os.environ, KERAS_BACKEND=MODES[mode], TF_CPP_MIN_LOG_LEVEL="3")
    if mode == "jax-dataparallel":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    command = [sys.executable, "-m", module, "--mode", mode]
    result = subprocess.run(
        command + arguments,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    records = [
        json.loads(line)
        for line in result.stdout.splitlines()
        if line.startswith("{")
    ]
    if result.returncode != 0:
        # Keep what the worker measured; report the failure in the table.
        tail = result.stderr.strip().splitlines()[-12:]
        print(f"worker failed ({mode} {' '.join(arguments)}):", flush=True)
        print("\n".join(tail), flush=True)
        records.append(
            {
                "mode": mode,
                "failed": " ".join(arguments),
                "returncode": result.returncode,
                "stderr_tail": tail,
            }
        )
    return records


def machine():
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=DEFAULT_MODES
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results"
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        help="time only these optimizers (default: all of worker.py's)",
    )
    parser.add_argument(
        "--workloads", nargs="+", help="time only these workloads"
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)

    smoke = ["--smoke", "--optimizers", "adam"] if args.smoke else []
    selected = []
    if args.optimizers and not args.smoke:
        selected += ["--optimizers", *args.optimizers]
    if args.workloads:
        selected += ["--workloads", *args.workloads]
    repeats = 1 if args.smoke else args.repeats
    started = time.time()
    results = {
        "command": "python -m benchmarks.run " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "repeats": repeats,
        "smoke": args.smoke,
        "seconds": 0,
        "timings": [],
        "memory": [],
        "failures": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        print(f"timing {mode} ...", flush=True)
        distributed = mode in DISTRIBUTED_MODES
        only_mlp = ["--workloads", "mlp"] if distributed else []
        _collect(
            results,
            "timings",
            _worker(
                mode,
                ["--repeats", str(repeats), *smoke, *selected, *only_mlp],
            ),
        )
        if not (args.no_memory or distributed):
            workloads = ["mlp"] if args.smoke else list(MEMORY_WORKLOADS)
            configs = ["ours_k4"] if args.smoke else MEMORY_CONFIGS
            for workload in workloads:
                for config in configs:
                    memory_arguments = [
                        "--memory",
                        config,
                        "--workloads",
                        workload,
                        "--optimizers",
                        "adam",
                        *smoke[:1],
                    ]
                    _collect(results, "memory", _worker(mode, memory_arguments))
        # Written after every mode, so a later failure loses nothing.
        results["seconds"] = round(time.time() - started)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    markdown = report.markdown(results)
    (args.out / "results.md").write_text(markdown)
    report.chart(results, args.out / "results.png")
    print(markdown)
    return results


def _collect(results, key, records):
    for record in records:
        results["failures" if "failed" in record else key].append(record)


if __name__ == "__main__":
    main()
