"""MoonshotAI checkpoint-engine (0.4.2) behind weightsync's lifecycle, its code unmodified.

checkpoint-engine's colocated update: the trainer's `ParameterServer` pins a registered checkpoint in host
memory, copies it bucket by bucket into a GPU buffer that it shares once by CUDA IPC, and tells the inference
worker on the same GPU what each bucket holds over a ZMQ REQ socket; the worker
(`checkpoint_engine.worker.update_weights_from_ipc`, a ZMQ REP socket) hands each bucket's tensors to a `run`
callback and answers. `ParameterServer.update(name, req_func)` calls `req_func(socket_paths)` in a thread so
the caller can ask the inference engine to connect (upstream's example posts it to vLLM's /collective_rpc).

What maps to what:

| weightsync | checkpoint-engine |
| --- | --- |
| `Sender.init()` | `ParameterServer(rank=0, world_size=1, auto_pg=..., master_addr, master_port)`, once per sender |
| `Sender.prepare(v, tensors)` | `register_checkpoint(name, named_tensors=tensors)` (pinned host copy), `gather_metas(name)`; the
  process group is opened with `init_process_group(timeout=timeout_s)` where none is open |
| `Sender.transmit()` | `update(name, req_func, timeout=timeout_s)`: its buckets through its IPC buffer and ZMQ socket;
  `req_func` hands `socket_paths` to the receiver (the harness's stand-in for the HTTP request to the engine) |
| `Receiver.update_weights(info)` | `update_weights_from_ipc(zmq.Context(), socket_path, device_id, run=copy_out)`; the
  harness's StagingReceiver checks names, shapes, digests and commits at finish, as for every path |
| `Sender.complete(...)` | `unregister_checkpoint(name)` |
| bucket size (`deploy(bucket_bytes=...)`) | `PS_MAX_BUCKET_SIZE_GB`, read by `update()` (its floor is the largest tensor) |

The adapter adds no transport and no deadline of its own: a call of checkpoint-engine that does not return is
bounded by the harness (`deliver`'s 2x timeout), and only after that does `transmit` give up waiting for it
(its thread, a daemon, is left where it blocks; `diagnose()` names the line).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch

from harness.api import (
    DEFAULT_TIMEOUT_S,
    JSON,
    Backend,
    BackendError,
    Capabilities,
    Deployment,
    DeployRequest,
    ManifestMismatch,
    Sender,
    TransferError,
)
from harness.launch import RankDeployment
from harness.manifest import Manifest
from harness.paths.base import StagingReceiver

INIT_KIND = "checkpoint-engine"
RENDEZVOUS_DIR = "checkpoint-engine"  # under the deployment's workdir: where req_func leaves socket_paths
GIB = 1 << 30
#: `transmit` stops waiting for a ParameterServer.update that has not returned after this multiple of the
#: timeout: past the harness's own bound (deliver: 2x), so the harness, not the adapter, judges the hang.
ABANDON_FACTOR = 2.5


def import_checkpoint_engine():
    """The checkpoint_engine package, or BackendError saying how to install it."""
    try:
        import checkpoint_engine
    except ImportError as exc:
        raise BackendError(
            f"checkpoint-engine is not importable ({type(exc).__name__}: {exc}); install checkpoint-engine==0.4.2 "
            "with pyzmq, loguru and its fastapi/pydantic set (adapters/checkpoint_engine/README.md)"
        ) from exc
    return checkpoint_engine


def device_manager():
    """checkpoint-engine's own device detection (CUDA or Ascend), or BackendError where it finds none."""
    import_checkpoint_engine()
    from checkpoint_engine.device_utils import DeviceManager

    try:
        return DeviceManager()
    except TypeError as exc:  # DeviceManager._detect_device_type: "The current device type is not supported"
        raise BackendError(
            f"checkpoint-engine needs a CUDA (or Ascend NPU) device and this host has none: its DeviceManager "
            f"says {exc!s} (torch.cuda.is_available() is {torch.cuda.is_available()}); run it with "
            "--weightsync-device=cuda:0 on a GPU host"
        ) from exc


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environ(**values: str | None):
    """os.environ with `values` set (None: removed) for the block, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_json(path: Path, data: JSON) -> None:
    """Atomically: a reader sees the whole file or none."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(data))
    os.replace(part, path)


def where_blocked(thread: threading.Thread) -> str:
    """The innermost frames of checkpoint-engine's code (else of any code) a thread is in now."""
    frame = sys._current_frames().get(thread.ident or -1)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    ours = [f for f in frames if "checkpoint_engine" in f.f_code.co_filename] or frames
    if not ours:
        return "(no frame)"
    inner = ours[0]
    path = inner.f_code.co_filename
    short = path[path.rfind("checkpoint_engine") :] if "checkpoint_engine" in path else path
    line = ""
    with contextlib.suppress(OSError, IndexError):
        line = Path(path).read_text().splitlines()[inner.f_lineno - 1].strip()
    innermost = frames[0]
    return (
        f"{short}:{inner.f_lineno} in {inner.f_code.co_name} ({line}); innermost "
        f"{Path(innermost.f_code.co_filename).name}:{innermost.f_lineno} in {innermost.f_code.co_name}"
    )


class _Update:
    """One ParameterServer.update running on a daemon thread of its own."""

    def __init__(self, name: str, target) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.started = time.monotonic()

        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - handed to transmit()
                self.error = exc

        self.thread = threading.Thread(target=run, name=f"checkpoint-engine-update-{name}", daemon=True)
        self.thread.start()

    def describe(self) -> str:
        return (
            f"checkpoint-engine's ParameterServer.update({self.name!r}) has not returned after "
            f"{time.monotonic() - self.started:.1f} s; blocked at {where_blocked(self.thread)}"
        )


# --------------------------------------------------------------------------------------------- trainer
class CheckpointEngineSender(Sender):
    """The trainer's side: one checkpoint-engine ParameterServer (rank 0 of a world of 1, on this GPU)."""

    def __init__(
        self,
        workdir: Path,
        timeout_s: float,
        bucket_bytes: int | None = None,
        auto_pg: bool = True,
        mem_fraction: float | None = None,
    ):
        self.workdir = workdir
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.auto_pg = auto_pg
        self.mem_fraction = mem_fraction
        self.ps = None
        self._seq = itertools.count()
        self._registered: str | None = None  # the checkpoint prepare() registered, until complete()
        self._rendezvous: Path | None = None
        self._updates: list[_Update] = []  # updates whose thread may still run (a hung one stays here)

    @property
    def rendezvous_dir(self) -> Path:
        return self.workdir / RENDEZVOUS_DIR

    def init(self) -> JSON:
        import_checkpoint_engine()
        self.rendezvous_dir.mkdir(parents=True, exist_ok=True)
        self._sweep_rendezvous()
        if self.ps is None:
            from checkpoint_engine import ParameterServer

            device_manager()  # a clear error where checkpoint-engine finds no device
            # ParameterServer reads $RANK when rank is falsy (`rank or int(os.environ["RANK"])`): rank 0 must be
            # given there too
            with environ(RANK="0"):
                self.ps = ParameterServer(
                    rank=0,
                    world_size=1,
                    auto_pg=self.auto_pg,
                    mem_fraction=self.mem_fraction,
                    master_addr="127.0.0.1",
                    master_port=free_port(),
                )
        return {"kind": INIT_KIND, "timeout_s": self.timeout_s, "rendezvous_dir": str(self.rendezvous_dir)}

    def _sweep_rendezvous(self) -> None:
        """Rendezvous files of trainers that are gone (a killed trainer cannot remove its own)."""
        from harness.procs import pid_alive

        for f in self.rendezvous_dir.glob("*.json*"):
            pid = f.name.split("-", 2)[1] if f.name.startswith("ws-") else ""
            if pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
                f.unlink(missing_ok=True)

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        if self.ps is None:
            raise TransferError("prepare before init: no ParameterServer")
        self.complete(False)  # a version prepared and never completed is unregistered first
        manifest = Manifest.build(version, named_tensors)
        tensors = dict(named_tensors)  # register_checkpoint takes a dict (the trainer reads each tensor here)
        name = f"ws-{os.getpid()}-{next(self._seq)}-v{version}"
        from checkpoint_engine import distributed as ce_dist

        try:
            self.ps.register_checkpoint(name, named_tensors=tensors)
            self._registered = name
            if not ce_dist.is_initialized():
                # with auto_pg gather_metas would open it with its default 10 minutes (update(timeout=) then finds
                # it open); without, it must be open before gather_metas. update() destroys it with auto_pg.
                self.ps.init_process_group(timeout=timedelta(seconds=self.timeout_s))
            self.ps.gather_metas(name)
        except Exception as exc:
            raise TransferError(
                f"version {version}: checkpoint-engine could not stage it ({type(exc).__name__}: {exc})"
            ) from exc
        self._rendezvous = self.rendezvous_dir / f"{name}.json"
        return {"manifest": manifest.to_json(), "checkpoint": name, "rendezvous": str(self._rendezvous)}

    def transmit(self) -> None:
        name, rendezvous, ps = self._registered, self._rendezvous, self.ps
        if name is None or rendezvous is None or ps is None:
            raise TransferError("transmit before prepare: nothing registered with checkpoint-engine")
        handed = threading.Event()

        def req_func(socket_paths) -> None:
            """Where upstream's example posts `socket_paths` to the inference engine: the receiver waits for it."""
            write_json(rendezvous, {"checkpoint": name, "socket_paths": dict(socket_paths)})
            handed.set()

        def update() -> None:
            bucket = (
                {} if self.bucket_bytes is None else {"PS_MAX_BUCKET_SIZE_GB": repr(self.bucket_bytes / GIB)}
            )
            try:
                with environ(**bucket):
                    ps.update(name, req_func, timeout=timedelta(seconds=self.timeout_s))
            except BaseException as exc:
                if not handed.is_set():  # the receiver waits for socket paths that will never come: tell it
                    write_json(rendezvous, {"checkpoint": name, "error": f"{type(exc).__name__}: {exc}"})
                raise

        run = _Update(name, update)
        self._updates = [u for u in self._updates if u.thread.is_alive()] + [run]
        run.thread.join(ABANDON_FACTOR * self.timeout_s)
        if run.thread.is_alive():  # the harness has given up on this push already (deliver: 2x timeout)
            raise TransferError(run.describe() + " (abandoned: its thread stays blocked)")
        if run.error is not None:
            raise TransferError(
                f"checkpoint-engine's update of {name!r} failed: {type(run.error).__name__}: {run.error}"
            ) from run.error

    def diagnose(self) -> list[str]:
        """After a failed push: any checkpoint-engine update still blocked, and where."""
        return [u.describe() for u in self._updates if u.thread.is_alive()]

    def complete(self, committed: bool) -> None:
        name, self._registered = self._registered, None
        if self._rendezvous is not None:
            self._rendezvous.unlink(missing_ok=True)
            self._rendezvous.with_name(self._rendezvous.name + ".part").unlink(missing_ok=True)
            self._rendezvous = None
        if name is not None and self.ps is not None:
            self.ps.unregister_checkpoint(name)

    def shutdown(self) -> None:
        self.complete(False)
        self.ps = None  # a ParameterServer has no close(); its TCPStore and ZMQ context go with it


# --------------------------------------------------------------------------------------------- engine side
class CheckpointEngineReceiver(StagingReceiver):
    """The inference worker's side: `update_weights_from_ipc`, its `run` copying every tensor out of the
    shared bucket into the engine's memory (the worker extension's `model.load_weights` in vLLM)."""

    #: checkpoint-engine's worker must take part in every update it is handed, even one it will refuse, or
    #: the trainer's ZMQ socket waits for it: the receiver drains what it refuses, as a collective does
    must_drain = True

    def __init__(self, engine):
        super().__init__(engine)
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.rendezvous_dir: Path | None = None
        self._zmq_ctx = None
        self._device_id: int | None = None
        self._device_uuid: str | None = None

    def _init(self, init_info: JSON) -> None:
        if init_info.get("kind") != INIT_KIND or "rendezvous_dir" not in init_info:
            raise ManifestMismatch(
                f"init_info is not checkpoint-engine's: kind {init_info.get('kind')!r}, keys {sorted(init_info)}"
            )
        self.timeout_s = float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.rendezvous_dir = Path(init_info["rendezvous_dir"]).resolve()
        import zmq
        from checkpoint_engine.ps import _get_physical_gpu_id  # the id ParameterServer keys socket paths by

        manager = device_manager()
        if self._zmq_ctx is None:
            self._zmq_ctx = zmq.Context()  # one per worker, as VllmColocateWorkerExtension keeps one
        self._device_id = manager.device_module.current_device()
        self._device_uuid = _get_physical_gpu_id(manager, self._device_id)

    def _socket_path(self, manifest: Manifest, update_info: JSON) -> str:
        """Wait (up to the timeout) for the socket paths the trainer's req_func hands over."""
        assert self.rendezvous_dir is not None, "init_transfer_engine first"
        where = Path(str(update_info.get("rendezvous", ""))).resolve()
        if where.parent != self.rendezvous_dir:
            raise ManifestMismatch(
                f"version {manifest.version}: rendezvous {where} is not in {self.rendezvous_dir}"
            )
        deadline, pause = time.monotonic() + self.timeout_s, 0.0002
        while not where.exists():
            if time.monotonic() > deadline:
                raise TransferError(
                    f"version {manifest.version}: checkpoint-engine's trainer handed over no socket path within "
                    f"{self.timeout_s:g}s (ParameterServer.update never called its req_func)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        handed = json.loads(where.read_text())
        if "error" in handed:
            raise TransferError(
                f"version {manifest.version}: checkpoint-engine's update failed before it handed over its "
                f"socket paths: {handed['error']}"
            )
        paths = handed.get("socket_paths", {})
        if self._device_uuid not in paths:
            raise TransferError(
                f"version {manifest.version}: checkpoint-engine offers sockets for devices {sorted(paths)}, "
                f"none for this worker's {self._device_uuid}"
            )
        return paths[self._device_uuid]

    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        from checkpoint_engine.worker import update_weights_from_ipc

        path = self._socket_path(manifest, update_info)
        target = self.engine_device()
        wanted = set(manifest.names)
        out: dict[str, torch.Tensor] = {}
        repeated: list[str] = []

        def run(weights: list[tuple[str, torch.Tensor]]) -> None:
            # the views live in the trainer's shared bucket, rewritten after this returns: copied out here
            for name, view in weights:
                if name in out:
                    repeated.append(name)
                out[name] = view.to(target, copy=True)

        try:
            update_weights_from_ipc(self._zmq_ctx, path, self._device_id, run=run, post_hook=None)
        except Exception as exc:
            raise TransferError(
                f"version {manifest.version}: checkpoint-engine's update_weights_from_ipc failed: "
                f"{type(exc).__name__}: {str(exc).strip()[-800:]}"
            ) from exc
        if repeated:
            raise TransferError(
                f"version {manifest.version}: checkpoint-engine delivered {repeated[:5]} twice"
            )
        foreign = sorted(set(out) - wanted)
        if foreign:
            raise TransferError(
                f"version {manifest.version}: checkpoint-engine delivered tensors the version does not hold: "
                f"{foreign[:5]}"
            )
        return out

    def _shutdown(self) -> None:
        if self._zmq_ctx is not None:
            self._zmq_ctx.destroy(linger=0)
            self._zmq_ctx = None


# --------------------------------------------------------------------------------------------- backend
class CheckpointEngineBackend(Backend):
    """checkpoint-engine's colocated update on one GPU: one trainer rank, one inference worker."""

    name = "checkpoint-engine"
    # its weights are registered in pinned host memory and each update copies them to the GPU: the bound
    # is the host-to-device link (55 GB/s on the H200 host), not a copy on the GPU (2.1 TB/s)
    ceiling = "h2d-copy"

    def __init__(
        self,
        device: str = "cuda:0",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int | None = None,
        auto_pg: bool = True,
        mem_fraction: float | None = None,
    ):
        self.device = device
        self.timeout_s = timeout_s
        # None: checkpoint-engine's own bucket (PS_MAX_BUCKET_SIZE_GB, default 8 GiB)
        self.bucket_bytes = bucket_bytes
        self.auto_pg = auto_pg
        self.mem_fraction = mem_fraction
        # One worker per GPU: ParameterServer keys its ZMQ socket by the GPU's UUID, a REQ socket with one REP
        # peer; several engines need several GPUs and a trainer rank each. Not claimed: interposable (no tap
        # in its bucket loop), ipc (the harness's ipc suite forges the harness's own handle format), delta.
        self.capabilities = Capabilities(gpu=True, multi_receiver=False, max_receivers=1, buckets=True)

    def timeouts(self) -> dict[str, float]:
        """The waits this adapter sets: its own (the receiver's wait for socket paths, the rank calls) and the
        process group's (`init_process_group(timeout=)`, `update(timeout=)`). checkpoint-engine's ZMQ sockets
        have none to set; its TCPStore (10 min) and store barrier (5 min) are fixed in its code and wait only
        for other trainer ranks, of which there are none (README.md)."""
        return {
            "timeout_s": self.timeout_s,
            "process group (init_process_group/update timeout)": self.timeout_s,
        }

    def build(self, request: DeployRequest) -> Deployment:
        n_receivers = request.n_receivers
        if n_receivers != 1:
            raise BackendError(
                f"{self.name} updates one inference worker per GPU (its socket is keyed by the GPU), not {n_receivers}"
            )
        import_checkpoint_engine()
        device_manager()  # BackendError where checkpoint-engine finds no GPU: CI without one reports it by name
        if self.device.startswith("cuda") and torch.device(self.device).index not in (None, 0):
            raise BackendError(
                f"{self.name}: ParameterServer rank 0 runs on device 0 (rank % device count); expose {self.device} "
                f"as device 0 (CUDA_VISIBLE_DEVICES) instead"
            )
        sender = CheckpointEngineSender(
            Path(request.workdir),
            self.timeout_s,
            request.unit(self.bucket_bytes),
            auto_pg=self.auto_pg,
            mem_fraction=self.mem_fraction,
        )
        return RankDeployment(
            sender=sender,
            receiver_path="weightsync_checkpoint_engine.backend:CheckpointEngineReceiver",
            n_receivers=n_receivers,
            spec=request.spec,
            engine=request.engine,
            workdir=request.workdir,
            rank_init_info=lambda info, rank: info,
            timeout=self.timeout_s,
        )


def make_backend(device: str | None = None) -> CheckpointEngineBackend:
    """The factory `--weightsync-backend=weightsync_checkpoint_engine:make_backend` and `weightsync certify
    --backend weightsync_checkpoint_engine:make_backend` call. Settings from the environment, where set:
    WEIGHTSYNC_CE_TIMEOUT_S (default 60), WEIGHTSYNC_CE_AUTO_PG (1: checkpoint-engine opens and destroys its
    process group around every update, its recommended mode; 0: one group kept open),
    WEIGHTSYNC_CE_MEM_FRACTION (PS_MEM_FRACTION's role; default 0.9)."""
    env = os.environ
    return CheckpointEngineBackend(
        device=device or "cuda:0",
        timeout_s=float(env.get("WEIGHTSYNC_CE_TIMEOUT_S", DEFAULT_TIMEOUT_S)),
        auto_pg=env.get("WEIGHTSYNC_CE_AUTO_PG", "1") != "0",
        mem_fraction=float(env["WEIGHTSYNC_CE_MEM_FRACTION"])
        if env.get("WEIGHTSYNC_CE_MEM_FRACTION")
        else None,
    )
