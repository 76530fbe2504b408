"""The control server against idle and slow clients: deadlines for a request's headers and its body,
and a cap on open connections below this process's file limit.

uvicorn bounds neither: a socket that never sends a byte, or sends one header byte a second, holds a
file descriptor for as long as the client likes, and enough of them (about 1,100 on a 1,024-file limit)
stop the server from accepting the next caller. `bounded_h11_protocol(limits, counters)` is uvicorn's
own h11 protocol with three rules added:

- headers: a request's headers must be complete `header_timeout_s` after its first byte (or after the
  connection opened); trickling bytes does not extend the deadline;
- body: its body must be complete `body_timeout_s` after the headers;
- connections: at the cap, a new connection closes the oldest idle one (no request in progress: idle
  keep-alive, or still sending headers); when every open connection is busy it is answered 503 and
  closed, so callers already being served are never cut off.

Every closure is counted in the server's counters (`/stats` shows them under `connections`)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ACCEPT_BACKLOG", "ClientLimits", "bounded_h11_protocol"]

log = logging.getLogger("weightsync.control")

FD_RESERVE = 256  # descriptors kept for the engine, the data plane, logs and sockets being accepted
# asyncio accepts up to `backlog` sockets per loop turn, and an accepted socket can close an idle one
# only two or three turns later: about four batches are open before the first eviction frees a file.
# Keeping those batches inside the reserve keeps accept() from failing with EMFILE (which logs a
# traceback per socket and stops accepting for a second).
ACCEPT_BACKLOG = 48
BUSY_503 = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclasses.dataclass(frozen=True)
class ClientLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000  # lowered to the file limit minus FD_RESERVE where that is smaller

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClientLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_connections < 1:
            raise ValueError(f"ClientLimits.max_connections must be >= 1, got {self.max_connections}")

    def connection_cap(self) -> int:
        """max_connections, held below the soft RLIMIT_NOFILE so accept() never runs out of files."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - FD_RESERVE))


def bounded_h11_protocol(limits: ClientLimits, counters: collections.Counter) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with `limits` enforced, counting closures in `counters`."""
    cap = limits.connection_cap()

    class BoundedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._opened = time.monotonic()
            self._deadline: asyncio.TimerHandle | None = None
            self._watching: Any = None  # the request cycle whose body the deadline is for

        # -- phases
        def _busy(self) -> bool:
            """A request is being received or answered (a stream counts as busy)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self, seconds: float, phase: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire, phase)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self, phase: str) -> None:
            self._deadline = None
            if self.transport is None or self.transport.is_closing():
                return
            counters[f"connections_{phase}_timeout"] += 1
            log.info("closing %s: %s not complete in time", self.client, phase)
            self.transport.close()

        # -- asyncio.Protocol
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            full = len(self.connections) >= cap
            if full and not self._evict_idle():
                super().connection_made(transport)
                counters["connections_refused"] += 1
                transport.write(BUSY_503)
                transport.close()
                return
            super().connection_made(transport)
            self._arm(limits.header_timeout_s, "header")

        def data_received(self, data: bytes) -> None:
            idle = not self._busy()
            if idle and self._deadline is None:  # the first byte of a request on a kept-alive connection
                self._arm(limits.header_timeout_s, "header")
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return
            if not cycle.more_body:  # the whole request is here
                self._disarm()
                self._watching = cycle
            elif self._watching is not cycle:  # headers complete, body still coming
                self._watching = cycle
                self._arm(limits.body_timeout_s, "body")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _evict_idle(self) -> bool:
            idle = [c for c in self.connections if isinstance(c, BoundedH11Protocol) and not c._busy()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._opened)
            oldest._disarm()
            oldest.connections.discard(oldest)  # counted out now: its close completes on the next tick
            if oldest.transport is not None:
                oldest.transport.close()
            counters["connections_evicted"] += 1
            return True

    return BoundedH11Protocol
