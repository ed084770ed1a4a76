"""Launching cooperating JAX processes (`jax.distributed`) for a test.

`run_jax_processes` starts every process of one worker script over
127.0.0.1, waits with a deadline, and turns what went wrong into a test
outcome: a failure carrying the workers' output, a skip where the worker
reports that this installation cannot run it, or one more try on another
port where the coordinator's port was taken between choosing and binding.
"""

import socket
import time
from pathlib import Path

import pytest
from helpers import TESTS
from helpers import jax_worker_env
from helpers import start_logged

# What the coordinator prints when its port was taken meanwhile.
PORT_TAKEN = ("already in use", "Failed to add port")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (the system's
    choice); another program may still take it before the coordinator
    binds it, which `run_jax_processes` retries."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop(workers):
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def _launch(script, out_dir, processes, devices_per_process, timeout):
    """Starts the workers on a fresh port and waits for them all, or for
    the first to fail (its peers would wait on it until their own
    timeouts), or for `timeout` seconds; stops any still running.

    Returns:
        `(return codes, outputs, timed out)`, one code (`None` if killed)
        and one output (stdout and stderr) per process.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    env = jax_worker_env(devices_per_process)
    logs = [Path(out_dir) / f"process{i}.log" for i in range(processes)]
    workers = []
    try:
        for process_id, log in enumerate(logs):
            arguments = [TESTS / script, coordinator, process_id, out_dir]
            workers.append(start_logged(arguments, env, log))
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(worker.poll() is None for worker in workers):
            if any(worker.poll() for worker in workers):
                break  # one failed: the others cannot finish without it
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        _stop(workers)
    codes = [worker.returncode for worker in workers]
    outputs = [log.read_text() for log in logs]
    return codes, outputs, timed_out


def run_jax_processes(
    script,
    out_dir,
    *,
    processes,
    devices_per_process,
    timeout,
    unavailable_exit=None,
    attempts=3,
):
    """Runs `tests/<script> COORDINATOR PROCESS_ID OUT_DIR` as `processes`
    JAX processes on this host and returns when all exited with 0.

    Fails the test, with every worker's output, when one exits otherwise
    or all have not finished after `timeout` seconds (they are then
    killed); skips it when a worker exits with `unavailable_exit` (the
    worker prints why); tries again on a new port when the coordinator's
    port was taken.

    Args:
        script: the worker's file name, in `tests/`.
        out_dir: the folder the workers write to (their logs too).
        processes: how many processes (`jax.process_count()`).
        devices_per_process: host CPU devices in each process.
        timeout: seconds all processes together may take, per attempt.
        unavailable_exit: the exit code by which a worker says this
            installation cannot run it, or `None`.
        attempts: launches at most, when the port was taken.

    Returns:
        The workers' outputs, one string per process.
    """
    for attempt in range(1, attempts + 1):
        codes, outputs, timed_out = _launch(
            script, out_dir, processes, devices_per_process, timeout
        )
        report = "\n".join(
            f"--- process {i} (exit {code}):\n{output[-4000:]}"
            for i, (code, output) in enumerate(zip(codes, outputs))
        )
        if timed_out:
            pytest.fail(f"{script} did not finish in {timeout} s\n{report}")
        if unavailable_exit is not None and unavailable_exit in codes:
            index = codes.index(unavailable_exit)
            pytest.skip(outputs[index].strip().splitlines()[-1])
        if all(code == 0 for code in codes):
            return outputs
        port_taken = any(text in outputs[0] for text in PORT_TAKEN)
        if not (port_taken and attempt < attempts):
            pytest.fail(f"{script} failed\n{report}")
    raise AssertionError("unreachable")
