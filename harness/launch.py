"""Receiver ranks as processes: start on one host (forks of a warm server, harness.warm), serve
lifecycle and engine calls, supervise.

Each rank process holds one engine and one receiver. The parent talks to it through a pipe carrying
JSON headers and safetensors frames (harness.wire), and supervises it: a rank that dies is reported
with its exit code and log tail; a rank that does not answer within the timeout gets its Python
stacks dumped (faulthandler, SIGUSR1) into its log, is killed, and the call fails. Never a silent hang.

Why one file: the rank's process, its supervisor (death, hangs, stacks, restarts) and the pipe proxies share one
process handle and one deadline per call; what crosses the pipe is harness.ranks.protocol's table, not this file's.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import faulthandler
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from harness import checks, deadline, error_codec, phases, warm, wire
from harness.api import (
    DEFAULT_TIMEOUT_S,
    JSON,
    Deployment,
    Engine,
    EngineHandle,
    EngineStateError,
    GenerationRequest,
    InPlaceLoad,
    PauseMode,
    RankFailure,
    RankInfo,
    Receiver,
    RequestStream,
    Sender,
    TokenEvent,
    WeightSpec,
    WeightSyncError,
)
from harness.procs import describe_exit, process_state
from harness.ranks import protocol
from harness.registry import engine_path, load_object, make_engine

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
#: A rank restarted inside a watched phase gets this multiple of the slowest start measured at deploy,
#: which started every rank side by side (a lone restart competes with fewer): room for a host whose
#: load grew since the deploy, still a bound that catches a restart that hangs. Never less than
#: RESTART_FLOOR_S: a warm start is too short to scale (measured on 2 cores: 0.03 s quiet, 0.1-0.25 s
#: beside 4 busy loops), and under a second the host's scheduler decides more than the restart does.
RESTART_FACTOR = 4.0
RESTART_FLOOR_S = 1.0
#: What killing a rank that gave no reply may cost the supervisor beyond the call's timeout (the stack
#: dump's wait, the wait to see it gone: REAP_WAIT_S): the watch's bound on a restart leaves the
#: supervisor's kill this much room.
KILL_S = 0.25 + 5.0
REAP_WAIT_S = 0.25  # after a SIGKILL on a timeout: how long the error waits to see the rank gone


# ============================================================================ rank side
class _RankServer:
    def __init__(self, rank: int, receiver_path: str, engine_name: str | None, spec: WeightSpec | None):
        self.rank = rank
        self.engine_name = engine_name
        self.engine = make_engine(engine_name, spec)
        self.receiver = load_object(receiver_path)(self.engine)
        self.streams: dict[str, RequestStream] = {}
        self.load: InPlaceLoad | None = None  # an in-place load the parent opened on this rank's engine

    def target(self, kind: str) -> Engine | Receiver:
        """The engine or the receiver an operation of the table is served by (the engine changes at reset)."""
        return {"engine": self.engine, "receiver": self.receiver}[kind]

    def handle(
        self, op: str, args: dict[str, Any], tensors: dict[str, torch.Tensor] | None
    ) -> tuple[Any, Any]:
        """Returns (JSON result, tensors or None): the table's dispatch (harness.ranks.protocol)."""
        return protocol.serve(self, op, args, tensors)

    # ------------------------------------------------- the operations this server serves itself
    def op_reset(self, spec: WeightSpec | None) -> None:
        self.engine.shutdown()  # ends its open requests with 'abort'; their streams stay pollable
        self.engine = make_engine(self.engine_name, spec)
        self.receiver.rebind(self.engine)

    def op_in_place_begin(self, version: int) -> None:
        self.load = self.engine.begin_in_place_load(version)

    def _open_load(self, op: str) -> InPlaceLoad:
        if self.load is None:
            raise EngineStateError(f"{op}: no in-place load is open on rank {self.rank}")
        return self.load

    def op_in_place_write(self, named_tensors: dict[str, torch.Tensor]) -> None:
        return self._open_load("in_place_write").write(named_tensors)

    def op_in_place_commit(self) -> None:
        load, self.load = self._open_load("in_place_commit"), None
        return load.commit()

    def op_in_place_rollback(self) -> None:
        load, self.load = self._open_load("in_place_rollback"), None
        return load.rollback()

    def op_submit(self, request: GenerationRequest) -> None:
        self.streams[request.request_id] = self.engine.submit(request)

    def op_poll(self, after: dict[str, int], wait: float) -> dict[str, list[JSON]]:
        """Events after each request's cursor; waits (briefly) on the oldest open one if none is new."""
        out = {}
        for rid, seen in after.items():
            stream = self.streams.get(rid)
            out[rid] = [wire.event_to_json(ev) for ev in stream.events_after(seen, 0.0)] if stream else []
        if not any(out.values()) and after:
            rid, seen = next(iter(after.items()))
            if rid in self.streams:
                out[rid] = [wire.event_to_json(ev) for ev in self.streams[rid].events_after(seen, wait)]
        for rid, events in out.items():
            if events and events[-1]["finish_reason"] is not None:
                self.streams.pop(rid, None)
        return out

    def op_ping(self) -> int:
        return os.getpid()

    def op_take_phases(self) -> dict[str, dict[str, float]]:
        """Where this rank's time went since the last take (harness.phases)."""
        return phases.take()

    def op_weight_digests(self) -> dict[str, list]:
        """The oracle's read of the live weights, digested here (checks.live_digests): gigabytes read
        back need not cross the pipe to be compared."""
        return checks.live_digests(self.engine)

    def op_serve_control(self, token: str, allowed_dirs: list[str]) -> str:
        """This rank's engine and receiver behind the HTTP control plane; returns its URL."""
        from harness.control.app import ServerThread
        from harness.control.server import ControlServer, ServerConfig

        cfg = ServerConfig(token=token, allowed_dirs=tuple(Path(d) for d in allowed_dirs))
        self.control = ServerThread(ControlServer(self.engine, self.receiver, cfg)).start()
        return self.control.url

    def op_exit(self) -> None:
        """The engine and the receiver shut down; rank_main returns once this is answered."""
        self.engine.shutdown()
        self.receiver.shutdown()


def rank_main(conn, rank: int, receiver_path: str, engine_name: str | None, spec_json, log_path: str) -> None:
    """Entry point of a spawned rank process."""
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    if not getattr(load_object(engine_path(engine_name)), "manages_threads", False):
        torch.set_num_threads(
            1
        )  # N ranks share the host's cores (an engine that binds its own is left alone)
    try:
        server = _RankServer(rank, receiver_path, engine_name, wire.spec_from_json(spec_json))
    except BaseException as exc:
        conn.send_bytes(wire.dumps({"ok": False, "error": error_codec.to_json(exc)}))
        raise
    conn.send_bytes(wire.dumps({"ok": True, "result": os.getpid()}))
    while True:
        try:
            header = wire.loads(conn.recv_bytes())
        except EOFError:  # parent went away
            return
        tensors = wire.tensors_from_bytes(conn.recv_bytes()) if header.get("tensors") else None
        try:
            result, out = server.handle(header["op"], header.get("args", {}), tensors)
            conn.send_bytes(wire.dumps({"ok": True, "result": result, "tensors": out is not None}))
            if out is not None:
                conn.send_bytes(wire.tensors_to_bytes(out))
        except Exception as exc:  # noqa: BLE001 - every error goes back to the caller
            print(f"rank {rank}: {header['op']} raised {type(exc).__name__}: {exc}", file=sys.stderr)
            conn.send_bytes(wire.dumps({"ok": False, "error": error_codec.to_json(exc)}))
        if header["op"] == "exit":
            return


# ============================================================================ parent side
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
            self._reply("start", start_timeout)

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
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout):
            raise RankBusy(self._busy_message(op, timeout))
        try:
            self._settle(None, (op, timeout, deadline))
            self._check_usable(op, timeout, deadline)
            with self._running(op):
                self._send(op, tensors, wire.dumps({"op": op, "args": args, "tensors": tensors is not None}))
                return self._reply(op, deadline - time.monotonic())
        finally:
            self._lock.release()

    def begin(self, op: str, timeout: float | None = None, **args) -> PendingCall | None:
        """Send `op` (JSON arguments only) and return at once, its reply left on the pipe: the caller does
        other work meanwhile (the driver prepares a version while its ranks start) and reads it with
        `result()` of what this returns; a call made meanwhile reads it first, so the pipe stays free
        for others. Bounded as `call` is, from now. None where the request could not be sent without
        blocking (larger than BEGIN_MAX_BYTES): the caller makes the call instead."""
        header = wire.dumps({"op": op, "args": args, "tensors": False})
        if len(header) > BEGIN_MAX_BYTES:
            return None
        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout):
            raise RankBusy(self._busy_message(op, timeout))
        try:
            self._settle(None, (op, timeout, deadline))
            self._check_usable(op, timeout, deadline)
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

    def _reply(self, op: str, timeout: float, behind: tuple[str, float, float] | None = None):
        """The reply to `op`, within `timeout` (then the rank is killed); `behind`, a call waiting for this
        reply before it can send its own (op, timeout, deadline): RankBusy at its deadline, nothing killed."""
        deadline = time.monotonic() + timeout
        while not self._ready():
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
                self._broken = f"no reply to {op} within {timeout:g}s (killed; {why})"
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


@protocol.pipe_proxy("receiver")
class RemoteReceiver(Receiver):
    """A receiver in a rank process: every phase is an operation of the table (harness.ranks.protocol),
    its methods made from it."""

    def __init__(self, rank: RankProcess):
        self.rank = rank

    def begin(self, method: str, *args: Any) -> protocol.Pending | None:
        """Send lifecycle call `method` now and return its pending reply (RankProcess.begin), so the driver
        overlaps the rank's work with its own; None where it must be called instead."""
        return protocol.begin(self.rank, method, *args)


@protocol.pipe_proxy("engine")
class RemoteEngine(Engine):
    """An engine in a rank process: the methods that only call the rank are made from the table
    (harness.ranks.protocol); those written here do more on this side. One pump thread polls the rank
    for the events of every open request in a single call and feeds the local streams."""

    def __init__(self, rank: RankProcess):
        self.rank = rank
        self._active: dict[str, tuple[RequestStream, list[int]]] = {}  # id -> (stream, [events seen])
        # Never held across a call to the rank: a poll that waits for a rank which does not answer must
        # not make submit (or any caller) wait for it beyond its own deadline.
        self._state = threading.Lock()  # guards _active and _pump
        self._polling = FifoLock()  # serialises polls (no event pushed twice), in arrival order
        self._pump: threading.Thread | None = None
        self._reads_open = threading.Event()  # cleared while reads are held (a client that reads late)
        self._reads_open.set()

    def live_digests(self) -> dict[str, list]:
        """checks.live_digests of the engine, computed in the rank: name -> [dtype, shape, digest]."""
        return protocol.call(self.rank, "weight_digests")

    @contextlib.contextmanager
    def reads_held(self):
        """No event is read from the rank until the block ends: the engine goes on generating, and its
        events are read late, as a slow client would (a stamp taken at read time shows then)."""
        self._reads_open.clear()
        try:
            yield
        finally:
            self._reads_open.set()

    def _poll(self, wait: float) -> bool:
        """Fetch new events of every open request; False once none is open. Bounded by the rank's timeout
        (the wait for another poll included): RankBusy if a poll in flight holds the turn that long."""
        if not self._reads_open.is_set():  # reads held: read nothing (the pump waits, not spins)
            self._reads_open.wait(wait)
            return True
        timeout = self.rank.timeout
        deadline = time.monotonic() + timeout
        if not self._polling.acquire(timeout):
            raise RankBusy(self.rank._busy_message("poll", timeout))
        try:
            with self._state:
                if not self._active:
                    return False
                after = {rid: seen[0] for rid, (_, seen) in self._active.items()}
            left = deadline - time.monotonic()
            if left < min(timeout / 4, 1.0):  # too little left to wait for a reply: do not start the call
                raise RankBusy(self.rank._busy_message("poll", timeout))
            batches = protocol.call(self.rank, "poll", timeout=left, after=after, wait=wait)
            with self._state:
                for rid, events in batches.items():
                    entry = self._active.get(rid)
                    if entry is None:  # its submit failed meanwhile, or the pump gave up on the rank
                        continue
                    stream, seen = entry
                    for ev in events:
                        stream.push(wire.event_from_json(ev))
                    seen[0] += len(events)
                    if stream.done:
                        del self._active[rid]
                return bool(self._active)
        finally:
            self._polling.release()

    def _pump_loop(self) -> None:
        try:
            while True:
                try:
                    self._poll(0.02)
                except RankBusy:  # a long call (not a poll) holds the pipe: wait on while the rank lives
                    if not self.rank.healthy:
                        raise
                with self._state:  # ends only where submit sees it ended, so it starts another
                    if not self._active:
                        self._pump = None
                        return
        except WeightSyncError as exc:
            # the rank is gone: its open requests are lost, and their streams say so
            with self._state:
                for rid, (stream, seen) in self._active.items():
                    if not stream.done:
                        stream.push(TokenEvent(rid, seen[0], None, -1, "abort"))
                self._active.clear()
                self._pump = None
            print(f"rank {self.rank.rank}: open requests aborted: {exc}", file=sys.stderr)

    def submit(self, request: GenerationRequest) -> RequestStream:
        stream = RequestStream(request)
        rid = request.request_id
        with self._state:  # registered before the rank can produce an event for it
            previous = self._active.get(rid)
            self._active[rid] = (stream, [0])
        try:
            protocol.call(self.rank, "submit", request)
        except BaseException:
            with self._state:
                if self._active.get(rid, (None,))[0] is stream:
                    if previous is None:
                        del self._active[rid]
                    else:
                        self._active[rid] = previous
            raise
        with self._state:
            if self._pump is None or not self._pump.is_alive():
                self._pump = threading.Thread(target=self._pump_loop, name="remote-engine-pump", daemon=True)
                self._pump.start()
        return stream

    def abort_requests(self, request_ids) -> int:
        n = protocol.call(self.rank, "abort_requests", request_ids)
        self._poll(0.0)  # the aborts show in the local streams on return
        return n

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = False) -> None:
        protocol.call(self.rank, "pause", mode, clear_cache)
        self._poll(0.0)  # what the pause ended or froze shows in the local streams on return

    def begin_in_place_load(self, version: int) -> InPlaceLoad:
        protocol.call(self.rank, "in_place_begin", version)
        return _RemoteInPlaceLoad(self.rank)


@protocol.pipe_proxy("load")
class _RemoteInPlaceLoad(InPlaceLoad):
    """An in-place load open on a rank's engine (write, commit, rollback: made from the table)."""

    def __init__(self, rank: RankProcess):
        self.rank = rank


class RankDeployment(Deployment):
    """A Sender in this process (rank 0) and N receiver ranks in spawned processes, supervised.

    `connect()` runs `rank_init_info(init_info, rank)` for every rank concurrently with the sender's
    own join, because forming a process group is itself a collective. `recover()` restarts the ranks
    that died or were killed for not answering, then connects everyone again (a new group)."""

    def __init__(
        self,
        sender: Sender,
        receiver_path: str,
        n_receivers: int,
        spec: WeightSpec | None,
        engine: str | None,
        workdir: str,
        rank_init_info: Callable[[JSON, int], JSON],
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self.sender = sender
        self.timeout_s = timeout
        self.restarts = 0
        self._receiver_path, self._engine, self._rank_init_info = receiver_path, engine, rank_init_info
        self._spec = spec
        self._log_dir = Path(workdir) / "ranks"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.ranks: list[RankProcess] = []
        self.handles = []
        #: seconds each rank took to start at deploy (warm server booted before): a restart's budget
        self.start_s: dict[int, float] = {}
        try:
            self._prepare_spawn()
            # ranks start side by side: each builds its engine
            with cf.ThreadPoolExecutor(max_workers=max(n_receivers, 1), thread_name_prefix="spawn") as pool:
                futures = [pool.submit(self._timed_spawn, i + 1) for i in range(n_receivers)]
            for f in futures:  # keep what started, so close() stops it, then raise the first failure
                if f.exception() is None:
                    self.ranks.append(f.result())
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
            self.handles = [self._handle_for(r) for r in self.ranks]
            self.connect()
        except BaseException:
            self.close()
            raise

    def _prepare_spawn(self) -> None:
        """Before the first rank starts: boot the warm fork server (once per process), so the ranks'
        measured starts are their own."""
        warm.context()

    def _spawn_rank(self, rank: int, start_timeout: float = START_TIMEOUT) -> RankProcess:
        """Start receiver rank `rank` (first start and restarts); a subclass may place it elsewhere."""
        return RankProcess(
            rank,
            self._receiver_path,
            self._engine,
            self._spec,
            self._log_dir,
            self.timeout_s * RPC_SLACK,
            start_timeout,
        )

    def _timed_spawn(self, rank: int) -> RankProcess:
        t0 = time.monotonic()
        r = self._spawn_rank(rank)
        self.start_s[rank] = time.monotonic() - t0
        return r

    def restart_budget_s(self) -> float:
        """How long restarting one rank may take: RESTART_FACTOR x the slowest start measured at deploy
        (at least RESTART_FLOOR_S; START_TIMEOUT where nothing was measured)."""
        if not self.start_s:
            return START_TIMEOUT
        return max(RESTART_FACTOR * max(self.start_s.values()), RESTART_FLOOR_S)

    def _restart_rank(self, rank: int) -> RankProcess:
        """Start rank `rank` again. Inside a watched phase the phase's clock stops meanwhile and the
        restart has a budget of its own, from this deployment's measured starts (not the phase's)."""
        self._prepare_spawn()  # a warm server that died boots again here, not inside the restart's budget
        budget = self.restart_budget_s()
        slowest = max(self.start_s.values(), default=0.0)
        what = f"restarting rank {rank} (its ranks started in {slowest:.2f} s at deploy)"
        # a pause, not a longer phase: the phase keeps its budget for its own work whatever the restart
        # took, and a restart is judged by what starting a rank measured here, not by the phase's slack;
        # the supervisor's own kill fires first, with its specific error; the watch is the backstop
        with deadline.paused(what, budget + KILL_S + POLL_INTERVAL) as watched:
            try:
                return self._spawn_rank(rank, budget if watched else START_TIMEOUT)
            except RankFailure as exc:
                raise RankFailure(f"{what}: {exc}") from None

    def _handle_for(self, rank: RankProcess) -> EngineHandle:
        """How the trainer talks to a rank's receiver and engine (here: over its pipe)."""
        return EngineHandle(RemoteReceiver(rank), RemoteEngine(rank))

    def connect(self) -> None:
        """sender.init() and every rank's init_transfer_engine, concurrently; the first error is raised."""
        init_info = self.sender.init()
        errors: list[BaseException] = []

        def init_one(h: EngineHandle, rank: int) -> None:
            try:
                h.receiver.init_transfer_engine(self._rank_init_info(init_info, rank))
            except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)

        threads = [
            threading.Thread(target=init_one, args=(h, r.rank)) for h, r in zip(self.handles, self.ranks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def processes(self) -> list[RankInfo]:
        return [RankInfo(f"rank {r.rank}", r.pid, str(r.log_path)) for r in self.ranks]

    def healthy(self) -> bool:
        return all(r.healthy for r in self.ranks)

    def take_phases(self) -> list[dict[str, dict[str, float]]]:
        """Each rank's phase times since the last take (recorded when harness.phases was on at spawn)."""
        return [protocol.call(r, "take_phases") for r in self.ranks]

    def _restart_unhealthy(self) -> bool:
        """Replace every rank that died or was killed; True if any was."""
        restarted = False
        for i, r in enumerate(self.ranks):
            if not r.healthy:
                r.stop(timeout=2.0)
                fresh = self._restart_rank(r.rank)
                self.ranks[i] = fresh
                handle = self._handle_for(fresh)
                self.handles[i].receiver, self.handles[i].engine = handle.receiver, handle.engine
                self.restarts += 1
                restarted = True
        return restarted

    def recover(self) -> None:
        self._restart_unhealthy()
        for h in self.handles:  # an update left open on a rank that was unreachable when push aborted
            try:
                h.receiver.abort_weight_update()
            except WeightSyncError:
                pass
        self.sender.reset_base()  # a restarted engine holds version 0: delta must send whole tensors
        self.connect()

    def reset(self, spec: WeightSpec | None = None) -> None:
        self._spec = spec  # a rank restarted later gets the spec its siblings have
        if self._restart_unhealthy():
            self.connect()
        self.sender.reset()
        for r in self.ranks:
            protocol.call(r, "reset", spec=spec)

    def close(self) -> None:
        if self.ranks:
            with cf.ThreadPoolExecutor(max_workers=len(self.ranks), thread_name_prefix="stop") as pool:
                list(pool.map(lambda r: r.stop(), self.ranks))
        self.sender.shutdown()
