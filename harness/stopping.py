"""Prompt stopping: SIGINT or SIGTERM ends a command (bench, certify, validate-cluster) within STOP_BOUND_S,
whatever its main thread waits on.

Python runs a signal handler only when the main thread comes back to the interpreter; a wait inside C++ (a
c10d store wait of 120 s, a gloo collective) holds it for as long as the wait lasts. So the handler is two:
the usual one raises SystemExit(128 + signal) in the main thread, which unwinds and writes what the command
has (its partial bundle); and a watcher thread, woken through signal.set_wakeup_fd the moment the signal
lands, gives the main thread `grace_s` to do so, then writes the partial bundle itself (`on_overrun`), kills
every process below this one and ends the process (os._exit). A second signal ends it at once.

    with PromptStop(grace_s=6, on_overrun=write_partial) as stop:
        ...            # SystemExit(143) on SIGTERM; stop.stopped_at says when
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

#: The most a stopped command takes to end, from the signal to the exit.
STOP_BOUND_S = 10.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below `pid` (this one by default), children first, read from /proc."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found.append(child)
            found += descendants(child)
    return found


def kill_descendants(pid: int | None = None) -> None:
    """SIGKILL every process below `pid` (gathered first: a killed parent's children are reparented)."""
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process group this command started (start_new_session), if any of it is left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class PromptStop:
    """Bound the time from SIGINT/SIGTERM to the exit (see the module). `defer`: while True the main thread is
    not interrupted (it ends a bounded step of its own, reading `stopped_at`); the watcher's bound holds
    still. Installs only in the main thread; elsewhere (a test's thread) it does nothing."""

    def __init__(self, grace_s: float = STOP_BOUND_S - 2, on_overrun: Callable[[int], None] | None = None):
        self.grace_s, self.on_overrun = grace_s, on_overrun
        self.stopped_at: float | None = None
        self.signum: int | None = None
        self.defer = False
        self._left = threading.Event()
        self._installed = False

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        self._installed = True
        threading.Thread(target=self._watch, name="weightsync-stop-watcher", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if not self._installed:
            return
        self._left.set()
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)  # wakes the watcher, which closes the read end
        if self.stopped_at is not None:
            kill_descendants()  # a stopped command leaves no process behind

    def _handle(self, signum: int, frame) -> None:
        self._note(signum)
        if not self.defer:
            raise SystemExit(128 + signum)

    def _note(self, signum: int) -> None:
        if self.stopped_at is None:
            self.stopped_at, self.signum = time.monotonic(), signum

    def _watch(self) -> None:
        seen = 0
        try:
            while True:
                deadline = None if self.stopped_at is None else self.stopped_at + self.grace_s
                ready, _, _ = select.select(
                    [self._read], [], [], None if deadline is None else max(0.0, deadline - time.monotonic())
                )
                if not ready:  # the bound is reached and the command is still in the block
                    if not self._left.is_set():
                        self._end(self.signum or signal.SIGTERM, overrun=True)
                    continue
                got = os.read(self._read, 16)
                if not got:  # the command left the block
                    return
                signums = [b for b in got if b in SIGNALS]
                if signums:  # the watcher counts them itself: the main thread may have noted the first
                    seen += len(signums)
                    self._note(signums[0])
                    if seen > 1:
                        self._end(signums[-1], overrun=False)
        finally:
            os.close(self._read)

    def _end(self, signum: int, overrun: bool) -> None:
        """The main thread did not finish in time (or a second signal came): write what there is, end."""
        if overrun and self.on_overrun is not None:
            try:
                self.on_overrun(signum)
            except BaseException as exc:  # noqa: BLE001 - the exit must happen whatever the writer does
                print(
                    f"stopping: the partial bundle was not written ({type(exc).__name__}: {exc})",
                    file=sys.stderr,
                )
        waited = time.monotonic() - (self.stopped_at or time.monotonic())
        print(
            f"stopped by {signal.Signals(signum).name} ({waited:.1f} s after it; the main thread was still "
            "waiting): every process below this one killed",
            file=sys.stderr,
            flush=True,
        )
        kill_descendants()
        os._exit(128 + signum)
