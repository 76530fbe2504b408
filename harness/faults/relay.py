"""A TCP relay between an HTTP client and its server, that can cut one request mid-way or lose its
answer: the control plane's network faults on real sockets (no netem here; see
../shared/notes/fault-tools.md). One thread, one selector; every other byte passes untouched.

    relay = TcpRelay(("127.0.0.1", 8001)).start()
    relay.arm(b"/update_weights", "lose-answer")   # the next POST /update_weights: run, answer dropped
    ...                                            # the client talks to relay.url
    relay.fired  # what it did, or None
    relay.close()
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading

MODES = ("cut-request", "lose-answer")


class TcpRelay:
    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._peer: dict[socket.socket, socket.socket] = {}
        self._swallow: set[socket.socket] = set()  # upstream sockets whose next answer is dropped
        self._upstream_side: set[socket.socket] = set()
        self._armed: tuple[bytes, str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tcp-relay", daemon=True)
        self.fired: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def start(self) -> TcpRelay:
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._thread.start()
        return self

    def arm(self, path: bytes, mode: str, cut_fraction: float = 0.5) -> None:
        """One shot: the next `POST <path>` is cut after a fraction of its bytes ('cut-request': the
        server never sees it whole) or delivered and its answer dropped ('lose-answer': the server ran
        it, the client cannot know). Either way both sides of that connection are reset."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        with self._lock:
            self._armed, self.fired = (b"POST " + path + b" ", mode, cut_fraction), None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for s in list(self._peer):
            s.close()
        self._listener.close()
        self._sel.close()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.05):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif sock in self._peer:
                    self._pump(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            server = socket.create_connection(self.upstream, timeout=5.0)
        except OSError:
            _reset(client)
            return
        for s in (client, server):
            s.setblocking(True)  # sendall below; reads happen only when select says so
            self._sel.register(s, selectors.EVENT_READ)
        self._peer[client], self._peer[server] = server, client
        self._upstream_side.add(server)

    def _pump(self, sock: socket.socket) -> None:
        peer = self._peer[sock]
        try:
            data = sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        if sock in self._swallow:  # the answer the fault loses
            self.fired = f"lose-answer: {len(data)} bytes of the server's answer dropped, connection reset"
            self._drop(sock)
            return
        to_server = sock not in self._upstream_side
        with self._lock:
            armed = self._armed
        if to_server and armed and data.find(armed[0]) >= 0:
            needle, mode, fraction = armed
            start = data.find(needle)
            with self._lock:
                self._armed = None
            if mode == "cut-request":
                n = start + 1 + int(fraction * max(len(data) - start - 2, 0))  # never the whole request
                peer.sendall(data[:n])
                self.fired = f"cut-request: {needle.decode().strip()} cut after {n - start} of {len(data) - start} bytes"
                self._drop(sock)
                return
            self._swallow.add(peer)
        try:
            peer.sendall(data)
        except OSError:
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        """Reset both sides of a connection (RST, not FIN: a cut, not a polite close)."""
        peer = self._peer.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._peer.pop(s, None)
            self._swallow.discard(s)
            self._upstream_side.discard(s)
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            _reset(s)


def _reset(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
