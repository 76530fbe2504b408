"""Facts about processes by pid, read from the kernel (for supervisors, sweepers and leak checks)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def process_state(pid: int | None) -> str:
    """The kernel's one-letter state of a process ('T': stopped by a signal, 'Z': exited, not reaped),
    '?' if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def pid_alive(pid: int) -> bool:
    """Running or stopped; a zombie has exited and only waits to be reaped."""
    return process_state(pid) not in ("?", "Z")


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3' or 'killed by SIGKILL': how a dead process's end reads in an error."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def tasks(pid: int) -> list[int]:
    """The thread ids of process `pid` (none where it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before their children (/proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in tasks(p):
            try:
                children = [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out
