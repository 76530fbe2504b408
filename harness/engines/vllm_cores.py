"""Where a vLLM server's engine core runs on a small host.

vLLM's CPU worker binds its OpenMP threads to all CPUs but one, which it leaves to the scheduler (the
engine core process). The engine core then spin-waits for the worker's output (`shm_broadcast`: a
`sched_yield` loop for a second after each read) on that one free CPU, the one the API server and the
client that streams from it need: on 2 cores a control call (an abort, a pause) made while tokens stream
is answered only after a backlog of them. Measured with `suites/control/test_vllm_compat.py -k
"abort_by_id or pause_resume"` on the 2-core VM, five runs each way, alternating (2026-12-06): 87, 28,
146, 69, 27 s as vLLM starts it; 28, 27, 26, 26, 26 s with the engine core pinned to the worker's CPUs.

So, on a host of at most `SMALL_HOST_CPUS` CPUs, the harness pins the engine core's and the worker's
threads to the worker's CPUs once the server is healthy, leaving the last CPU to the API server and its
clients. `WEIGHTSYNC_VLLM_PIN_ENGINE_CORE`: 1 pins on any host, 0 never."""

from __future__ import annotations

import os
from pathlib import Path

from harness.procs import descendants, tasks

PIN_ENV = "WEIGHTSYNC_VLLM_PIN_ENGINE_CORE"
SMALL_HOST_CPUS = 4
#: the process names vLLM gives its engine core and worker processes (setproctitle)
PINNED_PROCESSES = ("VLLM::EngineCore", "VLLM::Worker")


def engine_core_cpus() -> set[int] | None:
    """The CPUs the engine core goes to (the worker's, as vLLM's automatic binding gives them: all but
    the last), or None where it is left where vLLM starts it."""
    setting = os.environ.get(PIN_ENV, "auto")
    cpus = sorted(os.sched_getaffinity(0))
    if setting == "0" or len(cpus) < 2 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None  # an explicit binding is the user's own layout
    if setting != "1" and len(cpus) > SMALL_HOST_CPUS:
        return None
    return set(cpus[:-1])


def engine_processes(server_pid: int) -> dict[int, str]:
    """The engine core and worker processes under `server_pid`: pid -> the name vLLM gave it."""
    found = {}
    for pid in descendants(server_pid):
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if name.startswith(PINNED_PROCESSES):
            found[pid] = name
    return found


def pin_engine_core(server_pid: int) -> list[int]:
    """Pin the engine core's and the worker's threads under `server_pid` to `engine_core_cpus()`; the pids
    pinned (none where nothing is to be pinned, or vLLM named its processes otherwise)."""
    cpus = engine_core_cpus()
    if cpus is None:
        return []
    pinned = []
    for pid in engine_processes(server_pid):
        try:
            for tid in tasks(pid):
                os.sched_setaffinity(tid, cpus)
        except OSError:  # gone meanwhile
            continue
        pinned.append(pid)
    return pinned
