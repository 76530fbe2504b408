"""The `Receiver` and `Engine` a trainer holds for a rank process, over its pipe: the methods that only
call the rank are made from harness.ranks.protocol's table (`pipe_proxy`); those written here do more on
this side (the engine's one pump thread feeds every open request's local stream)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any

from harness import wire
from harness.api import (
    Engine,
    GenerationRequest,
    InPlaceLoad,
    PauseMode,
    Receiver,
    RequestStream,
    TokenEvent,
    WeightSyncError,
)
from harness.launch.supervision import FifoLock, RankBusy, RankProcess
from harness.ranks import protocol


@protocol.pipe_proxy("receiver")
class PipeReceiver(Receiver):
    """A receiver in a rank process: every phase is an operation of the table (harness.ranks.protocol),
    its methods made from it."""

    def __init__(self, rank: RankProcess):
        self.rank = rank

    def begin(self, method: str, *args: Any) -> protocol.Pending | None:
        """Send lifecycle call `method` now and return its pending reply (RankProcess.begin), so the driver
        overlaps the rank's work with its own; None where it must be called instead."""
        return protocol.begin(self.rank, method, *args)


@protocol.pipe_proxy("engine")
class PipeEngine(Engine):
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
                self._pump = threading.Thread(target=self._pump_loop, name="pipe-engine-pump", daemon=True)
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
        return PipeInPlaceLoad(self.rank)


@protocol.pipe_proxy("load")
class PipeInPlaceLoad(InPlaceLoad):
    """An in-place load open on a rank's engine (write, commit, rollback: made from the table)."""

    def __init__(self, rank: RankProcess):
        self.rank = rank
