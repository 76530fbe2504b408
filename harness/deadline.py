"""Deadlines the harness enforces itself, whatever the backend under test does with its own timeouts.

A backend declares the waits its code may block on (`Backend.timeouts()`, by name, in seconds); a
declaration over the bound a suite asks for fails before anything runs. What a backend does not
declare is bounded by a watch: the work runs in a thread, phase by phase, each phase with a budget
of twice the timeout plus what that phase costs (spawning ranks, moving the payload); a phase that
overruns ends the work as a failure that names the phase, the rank calls in flight and the stacks.

    watch = PhaseWatch(timeout_s=4.0, on_overrun=lambda: kill(ranks))
    overrun = watch.run(body)          # body(watch) calls watch.phase("push") as it goes
    overrun.describe()                 # "phase 'push' overran its 18 s budget ...", or None

A phase that restarts a rank (push recovers a rank that died) does not pay the restart from its own
budget: the phase's clock stops while the restart runs (`paused`), and the restart is bounded by a
budget of its own, which the deployment derives from how long its ranks took to start (measured).
A phase on a loaded host gets the time its threads waited for a CPU on top of its budget, measured
(`harness.host_load`), at most MAX_EXTENSION times the budget; the overrun says how much it got.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

from harness.host_load import MAX_EXTENSION, SAMPLE_S, RunQueueMeter, watched_threads

#: What a phase may cost beyond the sync's own timeout: starting rank processes (at the first deploy of a
#: process, booting the warm fork server: torch imported once, 10 s beside 4 busy loops on 2 cores),
#: moving a cell's payload on a loaded 2-core runner. A rank restarted inside a phase is not paid from
#: these: it pauses the phase's clock and has a budget of its own (`paused`).
SETUP_S = 60.0
PHASE_SLACK_S = 10.0
#: After an overrun, how long the work has to clean up once its ranks are killed.
CLEANUP_GRACE_S = 15.0


def declared_timeouts(backend) -> dict[str, float]:
    """The waits `backend` declares, by name: its `timeouts()` if it has one, else its `timeout_s`."""
    if callable(getattr(backend, "timeouts", None)):
        return {str(k): float(v) for k, v in backend.timeouts().items()}
    if getattr(backend, "timeout_s", None) is not None:
        return {"timeout_s": float(backend.timeout_s)}
    return {}


def over_bound(backend, bound_s: float) -> list[str]:
    """One line per declared wait longer than `bound_s` (empty: every declared wait is bounded)."""
    return [
        f"{name} = {seconds:g} s"
        for name, seconds in sorted(declared_timeouts(backend).items())
        if seconds > bound_s
    ]


class Overran(Exception):
    """Raised in the watched work when it enters a phase after its deadline passed: it should only clean up."""


@dataclasses.dataclass
class Overrun:
    phase: str
    budget_s: float
    elapsed_s: float
    calls: str  # the rank calls in flight ('' if none)
    stacks: str  # the watched thread's stack when the budget ran out
    cleanup_done: bool = True
    during: str = ""  # what paused the phase's clock and overran its own budget ('' : the phase itself)
    waited_s: float = 0.0  # what its threads waited for a CPU (the host's load): added to the budget

    def describe(self) -> str:
        calls = self.calls or "no rank call in flight"
        tail = "" if self.cleanup_done else "; its cleanup did not end either (abandoned)"
        what = f"phase {self.phase!r}" + (f": {self.during}" if self.during else "") + " overran"
        load = (
            f" + {self.waited_s:.1f} s its threads waited for a CPU (capped at {MAX_EXTENSION:g}x)"
            if self.waited_s >= 0.05
            else ""
        )
        return (
            f"{what} its {self.budget_s:g} s budget{load} (stopped at {self.elapsed_s:.1f} s); {calls}{tail}"
        )


def phase_budget(phase: str, timeout_s: float) -> float:
    """Twice the timeout plus the phase's own cost: spawning ranks where the phase may (re)start them."""
    spawn = SETUP_S if phase in ("deploy", "recovery") else 0.0
    return 2 * timeout_s + PHASE_SLACK_S + spawn


#: The watch whose work runs in this thread (set by PhaseWatch.run in its worker), for `paused`.
_running = threading.local()


@contextlib.contextmanager
def paused(what: str, budget_s: float) -> Iterator[bool]:
    """`what` (e.g. "restarting rank 2") runs inside the watched phase of this thread, if there is one:
    the phase's clock stops for it and it gets `budget_s` of its own (an overrun names the phase and
    `what`). Yields whether a watch bounds it (False: no watched phase in this thread, nothing changes)."""
    watch: PhaseWatch | None = getattr(_running, "watch", None)
    if watch is None:
        yield False
        return
    with watch.pause(what, budget_s):
        yield True


class PhaseWatch:
    """Runs `body(watch)` in a thread; the caller's thread keeps the clock. `on_overrun` runs once when
    a phase overran (kill the ranks, so the blocked call returns and the work can clean up)."""

    def __init__(self, timeout_s: float, on_overrun: Callable[[], None] | None = None):
        self.timeout_s = timeout_s
        self.on_overrun = on_overrun
        self._cond = threading.Condition()
        self._phase: tuple[str, float, float] = ("start", time.monotonic(), phase_budget("start", timeout_s))
        self._pause: tuple[str, float, float] | None = None  # (what, since, its own budget) while paused
        self._done = False
        self._waited: dict[str, float] = {}  # per phase: what its threads waited for a CPU, pauses included
        self._clock: tuple[str, str] | None = None  # the phase (and pause) the meter counts for
        self._meter: RunQueueMeter | None = None
        self.overrun: Overrun | None = None
        self.error: BaseException | None = None

    def phase(self, name: str) -> None:
        """The watched work enters `name`; raises Overran if an earlier phase overran (only clean up now)."""
        with self._cond:
            if self.overrun is not None and name != "cleanup":
                raise Overran(self.overrun.describe())
            self._phase = (name, time.monotonic(), phase_budget(name, self.timeout_s))
            self._cond.notify_all()

    @contextlib.contextmanager
    def pause(self, what: str, budget_s: float) -> Iterator[None]:
        """The phase's clock stops while the block runs; the block gets `budget_s` of its own (the
        phase's deadline moves by the time the block took). One pause at a time (the watched thread's)."""
        with self._cond:
            self._pause = (what, time.monotonic(), budget_s)
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                _, since, _ = self._pause
                name, start, budget = self._phase
                self._phase = (name, start + (time.monotonic() - since), budget)
                self._pause = None
                self._cond.notify_all()

    def waited_in(self, phase: str) -> float:
        """What the threads of `phase` waited for a CPU so far (its pauses included), capped as its budget's
        extension is: a check that bounds the phase's time in its own way extends its bound by it."""
        with self._cond:
            total = self._waited.get(phase, 0.0)
            if self._meter is not None and self._clock is not None and self._clock[0] == phase:
                total += self._meter.waited_s()
        return min(total, MAX_EXTENSION * phase_budget(phase, self.timeout_s))

    def run(self, body: Callable[[PhaseWatch], None]) -> Overrun | None:
        """Run the work to its end or until a phase overruns (then `on_overrun`, and the work's
        cleanup gets CLEANUP_GRACE_S). The work's own exception is kept in `self.error`."""

        def target() -> None:
            _running.watch = self
            try:
                body(self)
            except Overran:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self.error = exc
            finally:
                _running.watch = None
                with self._cond:
                    self._done = True
                    self._cond.notify_all()

        worker = threading.Thread(target=target, name="phase-watch", daemon=True)
        worker.start()
        meter = self._meter = RunQueueMeter(watched_threads(worker))
        with self._cond:
            while not self._done:
                name, since, budget = self._phase
                during = ""
                if self._pause is not None:  # the phase's clock stands; the pause's own runs
                    during, since, budget = self._pause
                if self._clock != (name, during):
                    if self._clock is not None:  # the phase it counted for keeps what it waited
                        meter.sample()
                        self._waited[self._clock[0]] = (
                            self._waited.get(self._clock[0], 0.0) + meter.waited_s()
                        )
                    self._clock = (name, during)
                    meter.reset()
                else:
                    meter.sample()
                waited = min(meter.waited_s(), MAX_EXTENSION * budget)
                left = since + budget + waited - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, SAMPLE_S))
            if self._done:
                return self.overrun
            self.overrun = Overrun(
                name,
                budget,
                time.monotonic() - since,
                _calls_in_flight(),
                _stack_of(worker),
                during=during,
                waited_s=waited,
            )
        if self.on_overrun is not None:
            self.on_overrun()
        worker.join(CLEANUP_GRACE_S + 2 * self.timeout_s)
        self.overrun.cleanup_done = not worker.is_alive()
        return self.overrun


def _calls_in_flight() -> str:
    launch = sys.modules.get("harness.launch.supervision")  # not imported: no rank was ever started
    return launch.describe_calls_in_flight(0.0, dump_stacks=True) if launch is not None else ""


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""
