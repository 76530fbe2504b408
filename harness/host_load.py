"""How long the host kept the watched work waiting for a CPU: a phase's deadline extends by it.

A phase budget is set for the work on a machine that runs it; on a host loaded by other jobs the same
work takes longer only because its threads wait in the run queue. The kernel knows that wait
(/proc/<pid>/schedstat's run delay) only where delay accounting is on, which it rarely is; so the
meter samples what every Linux has: each watched thread's state and CPU time (/proc/<pid>/task/<tid>/stat).
Over an interval in which a thread was runnable (state R) at both samples, the time it did not spend on
a CPU is time it waited for one. A thread that is blocked (a pipe, a lock, a stopped peer) is not
runnable and accrues nothing: a hang still meets its deadline; a thread that spins forever on a loaded
host accrues wait, and the extension is capped (`MAX_EXTENSION`), so it meets a later one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from harness.procs import descendants, tasks

#: The extension a phase can get, as a multiple of its budget: a spinning hang on a loaded host still ends.
MAX_EXTENSION = 3.0
#: How often the phase watch samples (its clock thread wakes this often while a phase runs).
SAMPLE_S = 0.1
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _thread_stat(pid: int, tid: int) -> tuple[str, float] | None:
    """(state, CPU seconds) of one thread, or None where it is gone or /proc has no such file."""
    try:
        text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3 of the man page
    return fields[0], (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14, 15)


class RunQueueMeter:
    """Per watched thread, the seconds it was runnable but not running since `reset()`; `waited_s()` is the
    largest (the threads work side by side: the slowest one's wait is what the phase lost).
    `threads()` names the (pid, tid) pairs to watch, re-read at every sample (ranks come and go)."""

    def __init__(self, threads):
        self.threads = threads
        self._lock = threading.Lock()
        self._last: dict[tuple[int, int], tuple[float, str, float]] = {}
        self._waited: dict[tuple[int, int], float] = {}

    def reset(self) -> None:
        with self._lock:
            self._waited = {}
        self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        seen = {}
        for key in self.threads():
            stat = _thread_stat(*key)
            if stat is None:
                continue
            seen[key] = (now, *stat)
        with self._lock:
            for key, (t, state, cpu) in seen.items():
                before = self._last.get(key)
                if before is not None and before[1] == "R" and state == "R":
                    lost = (t - before[0]) - (cpu - before[2])
                    if lost > 2 * _TICK_S:  # CPU time counts in ticks: less is noise
                        self._waited[key] = self._waited.get(key, 0.0) + lost
            self._last = seen

    def waited_s(self) -> float:
        with self._lock:
            return max(self._waited.values(), default=0.0)


def watched_threads(worker: threading.Thread):
    """The threads a phase's work runs on: the watched worker thread of this process, and every thread of
    every live rank process (harness.launch.supervision's, where it is imported)."""
    me = os.getpid()

    def threads() -> list[tuple[int, int]]:
        keys = [(me, worker.native_id)] if worker.native_id is not None else []
        launch = sys.modules.get("harness.launch.supervision")
        if launch is not None:
            for pid in launch.live_rank_pids():
                keys += [(pid, tid) for tid in tasks(pid)]
        return keys

    return threads


def _busy_ticks() -> int:
    """CPU ticks the whole host spent busy (every CPU; steal included: a hypervisor's other guests)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def _tree_ticks(root: int) -> int:
    """CPU ticks (user + system) of `root` and every live descendant: this run's own work (its rank
    processes are forks of a fork server it started, so descendants too)."""
    total = 0
    for pid in [root, *descendants(root)]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total


class OtherLoad:
    """How many CPUs' worth of work other jobs ran on this host over an interval: the host's busy time
    (/proc/stat) less this process tree's own (/proc/<pid>/stat of it and its descendants). A throughput
    row measured while others took half a CPU or more is not evidence about the path (harness.bench)."""

    def __init__(self):
        self._t, self._host, self._ours = time.monotonic(), _busy_ticks(), _tree_ticks(os.getpid())

    def cores(self) -> float:
        """Other jobs' CPUs in use, on average, since this was made (0.0 where /proc says nothing)."""
        wall = time.monotonic() - self._t
        if wall <= 0:
            return 0.0
        others = (_busy_ticks() - self._host) - (_tree_ticks(os.getpid()) - self._ours)
        return max(0.0, others * _TICK_S / wall)
