"""The rank's side of a rank process: its loop (`rank_main`, what the parent spawns) and the operations
of harness.ranks.protocol's table it serves itself (reset, in-place loads, streams, digests, the control
plane); the rest go to its engine or receiver."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from harness import checks, error_codec, phases, wire
from harness.api import (
    JSON,
    Engine,
    EngineStateError,
    GenerationRequest,
    InPlaceLoad,
    Receiver,
    RequestStream,
    WeightSpec,
)
from harness.ranks import protocol
from harness.registry import engine_path, load_object, make_engine


class RankServer:
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
        server = RankServer(rank, receiver_path, engine_name, wire.spec_from_json(spec_json))
    except BaseException as exc:
        conn.send_bytes(wire.dumps({"ok": False, "error": error_codec.to_json(exc)}))
        raise
    conn.send_bytes(wire.dumps({"ok": True, "result": os.getpid()}))
    profile_dir = os.environ.get("WEIGHTSYNC_PROFILE_DIR")  # harness.profile_push: where the fixed cost goes
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        # from the (skip+1)-th update on: the warm-up's pushes (and the digest kernel's compile) left out
        skip = int(os.environ.get("WEIGHTSYNC_PROFILE_SKIP", "0"))
        starts = 0

        def before(op: str) -> None:
            nonlocal starts
            if op == "start_weight_update":
                starts += 1
                if starts == skip + 1:
                    profiler.enable()

        try:
            _serve(conn, rank, server, before)
        finally:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"rank{rank}-{os.getpid()}.pstats"))
        return
    _serve(conn, rank, server)


def _serve(conn, rank: int, server: RankServer, before=None) -> None:
    """Answer the driver's calls until it says exit or goes away (`before(op)` first, where given)."""
    while True:
        try:
            header = wire.loads(conn.recv_bytes())
        except EOFError:  # parent went away
            return
        if before is not None:
            before(header["op"])
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
