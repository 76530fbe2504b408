"""The parent's handle on one rank process (`RankProcess`): calls under a deadline (a rank that does
not answer is killed, its stacks dumped first), death reported with its exit and log tail, calls begun
now and read later; and the registry of this process's live ranks that hang reports, the host's load
and the memory bound read."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from harness import error_codec, host_load, warm, wire
from harness.api import RankFailure, WeightSpec
from harness.launch.rank_server import rank_main
from harness.procs import describe_exit, process_state
from harness.ranks import protocol

#: Ranks back large tensors with transparent huge pages (torch reads this at its first allocation, so
#: it is set here, before any rank is spawned). Every sync stages the new version in fresh memory the
#: engine then keeps; with 4 KiB pages its first touch costs about 3x the copy itself on these VMs
#: (64 MiB: 55 ms against 18 ms with huge pages, one thread).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

DEFAULT_RPC_TIMEOUT = 120.0
START_TIMEOUT = 600.0  # spawning a rank builds its engine (a real vLLM takes minutes on 2 cores)
#: A lifecycle call gets this multiple of the deployment's timeout before its rank is killed: the data
#: plane's own timeout fires first with its specific error; the kill is the backstop (a blocked read).
RPC_SLACK = 1.5
POLL_INTERVAL = 0.05  # how often a waiting parent checks that the rank is still alive
#: What killing a rank that gave no reply may cost the supervisor beyond the call's timeout (the stack
#: dump's wait, the wait to see it gone: REAP_WAIT_S): the watch's bound on a restart leaves the
#: supervisor's kill this much room.
KILL_S = 0.25 + 5.0
REAP_WAIT_S = 0.25  # after a SIGKILL on a timeout: how long the error waits to see the rank gone


class FifoLock:
    """A lock granted in arrival order. The rank's pipe is shared by the caller and the stream pump;
    with a plain Lock the pump, which re-takes it at once, can starve the caller on a fast host.

    `acquire(timeout)` gives up after `timeout` seconds. A waiter that gives up, or is interrupted by an
    exception while it waits (pytest-timeout's SIGALRM, a KeyboardInterrupt), abandons its ticket: the
    lock skips it, so it never blocks the tickets behind it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for this caller's turn, at most `timeout` seconds (None: no limit); True once held."""
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            granted = False
            try:
                granted = self._cond.wait_for(lambda: self._serving == ticket, timeout)
            finally:
                if not granted:  # timed out or interrupted: never leave a ticket that nobody serves
                    if self._serving == ticket:  # its turn came just as it gave up: pass it on
                        self._advance()
                    else:
                        self._abandoned.add(ticket)
            return granted

    def release(self) -> None:
        with self._cond:
            self._advance()

    def _advance(self) -> None:
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class RankBusy(RankFailure):
    """A call that could not get its rank's pipe before its deadline: another call holds it (the rank
    is not killed for this; the holder's own deadline does that if the rank does not answer)."""


@dataclasses.dataclass(frozen=True)
class CallInFlight:
    """A call a rank has not answered yet (for hang reports)."""

    rank: int
    pid: int | None
    op: str
    seconds: float
    log_path: Path
    stopped: bool  # SIGSTOPped: it cannot dump its stacks

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) in {self.op!r} for {self.seconds:.1f} s"


#: Every RankProcess of this process that has not been collected, for hang reports (calls_in_flight).
_LIVE_RANKS: weakref.WeakSet[RankProcess] = weakref.WeakSet()


def calls_in_flight(min_seconds: float = 0.0) -> list[CallInFlight]:
    """The calls live ranks of this process have in flight for at least `min_seconds`, oldest first."""
    now = time.monotonic()
    out = []
    for r in list(_LIVE_RANKS):
        current = r._in_flight
        if current is None or not r.process.is_alive():
            continue
        op, since = current
        if now - since >= min_seconds:
            stopped = process_state(r.pid) == "T"
            out.append(CallInFlight(r.rank, r.pid, op, now - since, r.log_path, stopped))
    return sorted(out, key=lambda c: -c.seconds)


def describe_calls_in_flight(min_seconds: float = 0.0, dump_stacks: bool = False) -> str:
    """'rank 1 (pid 1234) in 'poll' for 95.2 s; stacks in <log>' for each call in flight ('' if none).
    With dump_stacks, each such rank (unless SIGSTOPped) first writes its Python stacks to its log."""
    calls = calls_in_flight(min_seconds)
    parts = []
    for c in calls:
        where = f"log {c.log_path}"
        if c.stopped:
            where = f"it is stopped (SIGSTOP), no stacks; log {c.log_path}"
        elif dump_stacks:
            try:
                os.kill(c.pid, signal.SIGUSR1)  # faulthandler in rank_main dumps every thread's stack
                where = f"stacks in {c.log_path}"
            except (OSError, TypeError):
                pass
        parts.append(f"{c.describe()}; {where}")
    return "; ".join(parts)


def live_rank_count() -> int:
    """How many rank processes of this process are alive (the memory a run holds: about 150 MB each)."""
    return sum(1 for r in list(_LIVE_RANKS) if r.process.is_alive())


def live_rank_pids() -> list[int]:
    """The pids of this process's live ranks that have a call in flight (those doing a phase's work)."""
    return [r.pid for r in list(_LIVE_RANKS) if r._in_flight is not None and r.process.is_alive()]


def kill_live_ranks(grace_s: float = 0.0) -> None:
    """Kill every live rank of this process, `grace_s` after the first call (a process that is being
    stopped: its ranks finish their stack dumps, then do not outlive it)."""
    ranks = [r for r in list(_LIVE_RANKS) if r.process.is_alive()]
    if ranks and grace_s > 0:
        time.sleep(grace_s)
    for r in ranks:
        with contextlib.suppress(Exception):
            r.process.kill()


def kill_ranks_in_flight(grace_s: float = 0.0) -> None:
    """Kill the live ranks of this process that have a call in flight, `grace_s` after the first call
    (a test past its deadline: they finish their stack dumps; idle ranks of other deployments live on)."""
    ranks = [r for r in list(_LIVE_RANKS) if r.process.is_alive() and r._in_flight is not None]
    if ranks and grace_s > 0:
        time.sleep(grace_s)
    for r in ranks:
        with contextlib.suppress(Exception):
            r.process.kill()


#: The largest request `RankProcess.begin` sends: one the pipe's socket buffer (about 200 KiB on Linux)
#: takes whole while the rank is busy, or stopped, so sending it never blocks the caller.
BEGIN_MAX_BYTES = 32 << 10


class PendingCall:
    """A call sent by `RankProcess.begin` whose reply may not have been read yet."""

    def __init__(self, rank: RankProcess, op: str, deadline: float):
        self.rank, self.op, self.deadline = rank, op, deadline
        self.sent_at = time.monotonic()
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> bool:
        """Read the reply if it comes within `timeout` (None: by this call's deadline, past which the rank
        is killed); True once it is read. False leaves it on the pipe, the rank untouched."""
        if self.done:
            return True
        rank = self.rank
        # whoever holds the pipe reads this reply before its own, and gives it up by this deadline
        bound = max(self.deadline - time.monotonic(), 0.0) + KILL_S + POLL_INTERVAL
        if not rank._lock.acquire(bound if timeout is None else min(timeout, bound)):
            if timeout is None:
                raise RankBusy(rank._busy_message(self.op, bound))
            return False
        try:
            if timeout is None:
                rank._settle(self, None)
            else:
                try:
                    rank._settle(self, (self.op, timeout, time.monotonic() + timeout))
                except RankBusy:
                    return False
        finally:
            rank._lock.release()
        return True

    def result(self) -> Any:
        """The rank's reply, or what it raised (RankFailure: died, or killed at this call's deadline)."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self.value


class RankProcess:
    """A supervised rank: call(op, ...) returns its result or raises what the rank raised."""

    _in_flight: tuple[str, float] | None = None  # (op, time.monotonic() at its start) while a call runs

    def __init__(
        self,
        rank: int,
        receiver_path: str,
        engine: str | None,
        spec: WeightSpec | None,
        log_dir: Path,
        timeout: float = DEFAULT_RPC_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
    ):
        self.rank = rank
        self.timeout = timeout
        self.log_path = log_dir / f"rank{rank}.log"
        ctx = warm.context()  # a fork of a server that has imported torch: no import in the rank's start
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=warm.inherit,
            args=(
                warm.here(),
                rank_main,
                child,
                rank,
                receiver_path,
                engine,
                wire.spec_to_json(spec),
                str(self.log_path),
            ),
            name=f"weightsync-rank{rank}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self._lock = FifoLock()
        self._broken: str | None = None
        self._sent: collections.deque[PendingCall] = collections.deque()  # begun, reply not read yet
        with self._lock, self._running("start"):
            # a start is the rank's own work (building its engine, a CUDA context on a GPU): where the host
            # keeps its threads waiting for a CPU, its deadline moves by that wait, as a phase's does
            self._reply("start", start_timeout, meter=self._own_run_queue())

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def healthy(self) -> bool:
        """Alive and answering: not dead, not killed by a timeout, its pipe intact."""
        return self._broken is None and self.process.is_alive()

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def call(
        self, op: str, timeout: float | None = None, tensors: Mapping[str, torch.Tensor] | None = None, **args
    ):
        """Run `op` on the rank. `timeout` (default: the rank's) bounds the whole call, the wait for the
        pipe included: a call that cannot get the pipe in time raises RankBusy, naming the call that holds
        it; a rank that does not answer in time is killed (stacks dumped) and the call raises RankFailure.
        The replies of calls sent before it (`begin`) are read first, in the order they were sent."""
        with self._turn(op, timeout) as deadline, self._running(op):
            self._send(op, tensors, wire.dumps({"op": op, "args": args, "tensors": tensors is not None}))
            return self._reply(op, deadline - time.monotonic())

    def begin(self, op: str, timeout: float | None = None, **args) -> PendingCall | None:
        """Send `op` (JSON arguments only) and return at once, its reply left on the pipe: the caller does
        other work meanwhile (the driver prepares a version while its ranks start) and reads it with
        `result()` of what this returns; a call made meanwhile reads it first, so the pipe stays free
        for others. Bounded as `call` is, from now. None where the request could not be sent without
        blocking (larger than BEGIN_MAX_BYTES): the caller makes the call instead."""
        header = wire.dumps({"op": op, "args": args, "tensors": False})
        if len(header) > BEGIN_MAX_BYTES:
            return None
        with self._turn(op, timeout) as deadline:
            pending = PendingCall(self, op, deadline)
            self._in_flight = (op, pending.sent_at)
            _LIVE_RANKS.add(self)
            try:
                self._send(op, None, header)
            except BaseException:
                self._in_flight = None
                raise
            self._sent.append(pending)
            return pending

    @contextlib.contextmanager
    def _turn(self, op: str, timeout: float | None) -> Iterator[float]:
        """The rank's pipe for `op`, held until the block ends; yields the call's deadline, `timeout`
        (default: the rank's) from now. The pipe is waited for within it (else RankBusy, naming who holds
        it), the replies of calls begun before are read first, and a rank that is broken, or too little
        time left to wait for a reply, is refused before anything is sent."""
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout):
            raise RankBusy(self._busy_message(op, timeout))
        try:
            self._settle(None, (op, timeout, deadline))
            self._check_usable(op, timeout, deadline)
            yield deadline
        finally:
            self._lock.release()

    def _check_usable(self, op: str, timeout: float, deadline: float) -> None:
        if self._broken:
            raise RankFailure(f"rank {self.rank} (pid {self.pid}) is unusable: {self._broken}")
        if deadline - time.monotonic() < min(timeout / 4, 1.0):  # too little left to wait for a reply
            raise RankBusy(self._busy_message(op, timeout))

    def _send(self, op: str, tensors: Mapping[str, torch.Tensor] | None, header: bytes) -> None:
        try:
            self._conn.send_bytes(header)
            if tensors is not None:
                self._conn.send_bytes(wire.tensors_to_bytes(tensors))
        except OSError as exc:  # BrokenPipe: the rank is gone
            self.process.join(1.0)
            self._broken = f"died ({describe_exit(self.process.exitcode)}) before {op} ({exc})"
            raise RankFailure(
                f"rank {self.rank} (pid {self.pid}) {self._broken}; log tail:\n{self.log_tail()}"
            ) from None

    def _settle(self, until: PendingCall | None, caller: tuple[str, float, float] | None) -> None:
        """Read the replies of calls sent with `begin`, oldest first, into their PendingCall: all of them,
        or up to `until`. Each is bounded by its own deadline (past it the rank is killed, as `call` does);
        `caller` (op, timeout, deadline), a call waiting behind them, gives up with RankBusy at its own."""
        while self._sent and (until is None or not until.done):
            pending = self._sent[0]
            if self._broken:
                pending.error = RankFailure(f"rank {self.rank} (pid {self.pid}) is unusable: {self._broken}")
            else:
                try:
                    pending.value = self._reply(pending.op, pending.deadline - time.monotonic(), caller)
                except RankBusy:
                    raise  # left for its owner: this caller only gave up waiting behind it
                except Exception as exc:  # noqa: BLE001 - the owner's result() raises it
                    pending.error = exc
            pending.done = True
            self._sent.popleft()
            self._in_flight = (self._sent[0].op, self._sent[0].sent_at) if self._sent else None

    @contextlib.contextmanager
    def _running(self, op: str) -> Iterator[None]:
        """`op` is in flight on this rank until the block ends (calls_in_flight lists it)."""
        _LIVE_RANKS.add(self)
        self._in_flight = (op, time.monotonic())
        try:
            yield
        finally:
            self._in_flight = None

    def _busy_message(self, op: str, timeout: float) -> str:
        current = self._in_flight
        holder = (
            f"{current[0]!r} in flight for {time.monotonic() - current[1]:.1f} s"
            if current
            else "another call holds it"
        )
        return (
            f"rank {self.rank} (pid {self.pid}): {op} could not get the rank's pipe within {timeout:g}s "
            f"({holder}; the rank is left to that call's deadline)"
        )

    def _own_run_queue(self) -> host_load.RunQueueMeter:
        """The time this rank's threads waited for a CPU (host_load), from now."""
        pid = self.process.pid
        meter = host_load.RunQueueMeter(lambda: [(pid, tid) for tid in host_load.tasks(pid)])
        meter.reset()
        return meter

    def _reply(
        self,
        op: str,
        timeout: float,
        behind: tuple[str, float, float] | None = None,
        meter: host_load.RunQueueMeter | None = None,
    ):
        """The reply to `op`, within `timeout` (then the rank is killed); `behind`, a call waiting for this
        reply before it can send its own (op, timeout, deadline): RankBusy at its deadline, nothing killed.
        `meter`: the deadline moves by what it measured the rank waiting for a CPU (at most
        host_load.MAX_EXTENSION x `timeout`: a rank spinning forever on a loaded host still meets one)."""
        deadline = time.monotonic() + timeout
        waited = 0.0
        while not self._ready():
            if meter is not None:
                meter.sample()
                grown = min(meter.waited_s(), host_load.MAX_EXTENSION * timeout)
                deadline, waited = deadline + grown - waited, grown
            if behind is not None and time.monotonic() > behind[2] and time.monotonic() <= deadline:
                raise RankBusy(self._busy_message(behind[0], behind[1]))
            if not self.process.is_alive():
                self._broken = f"died ({describe_exit(self.process.exitcode)}) during {op}"
                raise RankFailure(
                    f"rank {self.rank} (pid {self.pid}) {self._broken}; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                stopped = process_state(self.pid) == "T"  # SIGSTOPped: it cannot dump its stacks
                if not stopped:
                    os.kill(self.process.pid, signal.SIGUSR1)  # faulthandler dumps every thread's stack
                    # the dump takes milliseconds; the kill must stay inside the bound
                    self.process.join(0.25)
                self.process.kill()
                # SIGKILL cannot be refused: the error need not wait for the kernel to reap it (a rank
                # holding a CUDA context took 1-2 s more to end on the H200, past the 2x-timeout bound)
                self.process.join(REAP_WAIT_S)
                why = "it was stopped (SIGSTOP)" if stopped else f"stacks in {self.log_path}"
                kept = f" + {waited:.2f}s the host kept it waiting for a CPU" if waited else ""
                self._broken = f"no reply to {op} within {timeout:g}s{kept} (killed; {why})"
                raise RankFailure(
                    f"rank {self.rank} (pid {self.pid}) gave {self._broken}; log tail:\n{self.log_tail(40)}"
                )
        try:
            header = wire.loads(self._conn.recv_bytes())
            tensors = wire.tensors_from_bytes(self._conn.recv_bytes()) if header.get("tensors") else None
        except (EOFError, OSError) as exc:
            self._broken = f"pipe closed during {op}: {exc}"
            raise RankFailure(f"rank {self.rank} {self._broken}; log tail:\n{self.log_tail()}") from None
        if not header["ok"]:
            raise error_codec.from_json(header["error"], f"rank {self.rank}")
        return tensors if tensors is not None else header["result"]

    def _ready(self) -> bool:
        """Whether a reply waits on the pipe (after up to POLL_INTERVAL s); RankFailure once it is closed
        (stop() closes it while a call it could not wait for still waits)."""
        try:
            return self._conn.poll(POLL_INTERVAL)
        except (OSError, ValueError) as exc:
            self._broken = self._broken or f"pipe closed ({exc})"
            raise RankFailure(f"rank {self.rank} (pid {self.pid}) {self._broken}") from None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.is_alive() and not self._broken:
            try:
                protocol.call(self, "exit", timeout=timeout)
            except Exception:  # noqa: BLE001, S110 - we kill it below anyway
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self._conn.close()
