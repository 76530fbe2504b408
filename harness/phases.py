"""Where a sync's time goes: exclusive wall time per phase, per role, in each process.

Code on the data path marks its steps with `with phase("digest"):`. Nothing is recorded unless
recording is on (`record()` in this process, WEIGHTSYNC_PHASES=1 in spawned ranks), so the marks cost a
branch in production. Phases nest; a nested phase pauses its parent, so the parts of one role never
overlap and sum to at most that role's wall time. The role is per thread: receivers set it around
their lifecycle calls, everything else counts as the sender (the trainer).

On a GPU the clock is the host's: a phase ends with a device synchronize while recording, so the
kernels it queued are counted in it (never while not recording: production keeps its async queue).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

#: The parts of a sync, in the order a stacked bar draws them.
PHASES = ("digest", "alloc", "pack", "wire", "open", "unpack", "verify", "commit")
ENV = "WEIGHTSYNC_PHASES"

_lock = threading.Lock()
_totals: dict[tuple[str, str], float] = defaultdict(float)
_local = threading.local()
_enabled = os.environ.get(ENV) == "1"


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn recording on or off in this process (and, through the environment, in ranks spawned later)."""
    global _enabled
    _enabled = on
    if on:
        os.environ[ENV] = "1"
    else:
        os.environ.pop(ENV, None)


@contextlib.contextmanager
def role(name: str) -> Iterator[None]:
    """Count the phases this thread marks inside the block as `name`'s ('sender' or 'receiver')."""
    previous = getattr(_local, "role", "sender")
    _local.role = name
    try:
        yield
    finally:
        _local.role = previous


def _sync_device() -> None:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001, S110 - a clock must never break the sync it times
        pass


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    if not _enabled:
        yield
        return
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    who = getattr(_local, "role", "sender")
    now = time.perf_counter()
    if stack:  # pause the enclosing phase
        outer, since = stack[-1]
        _add(who, outer, now - since)
    stack.append((name, now))
    try:
        yield
    finally:
        _sync_device()
        end = time.perf_counter()
        _, since = stack.pop()
        _add(who, name, end - since)
        if stack:
            stack[-1] = (stack[-1][0], end)


def _add(who: str, name: str, seconds: float) -> None:
    with _lock:
        _totals[(who, name)] += seconds


def take() -> dict[str, dict[str, float]]:
    """{role: {phase: seconds}} recorded since the last take(), and clear it."""
    with _lock:
        out: dict[str, dict[str, float]] = {}
        for (who, name), s in _totals.items():
            out.setdefault(who, {})[name] = s
        _totals.clear()
    return out
