"""Collective broadcast of packed byte buckets from the trainer (rank 0) to N receiver ranks.

gloo on CPU, NCCL on CUDA, same code. Groups are built explicitly from a TCPStore (not the global
default group), so a trainer can hold several and a rank can rebuild one after a fault. A collective
that does not complete within `timeout_s` raises, and the caller gets a TransferError: a dead or
stalled rank makes the others fail in bounded time.
"""

from __future__ import annotations

import datetime
import itertools
import os
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

from harness import phases
from harness.api import (
    DEFAULT_TIMEOUT_S,
    JSON,
    ManifestMismatch,
    Sender,
    TransferError,
    apply_cut,
)
from harness.manifest import DEFAULT_BUCKET_BYTES, Manifest, as_bytes
from harness.paths.base import StagingReceiver

# The trailer every transfer ends with: [status, bucket]. A trainer that fails mid-transfer still sends
# every bucket (filler), so no rank is left blocked and the group stays usable, then says ABANDONED.
COMPLETE, ABANDONED = 0, 1


def make_group(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float, store=None):
    """A process group of `world` ranks rendezvousing at addr:port; rank 0 hosts the store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore("weightsync/broadcast/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    raise ValueError(f"broadcast backend must be 'gloo' or 'nccl', got {backend!r}")


def device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _start(group, buf: torch.Tensor, what: str):
    try:
        with phases.phase("wire"):
            return group.broadcast(buf, 0)
    except RuntimeError as exc:
        raise TransferError(f"broadcast of {what} failed: {exc}") from None


def _wait(work, what: str) -> None:
    try:
        with phases.phase("wire"):
            work.wait()
    except RuntimeError as exc:
        raise TransferError(f"broadcast of {what} failed: {exc}") from None


def broadcast_one(group, buf: torch.Tensor, what: str) -> None:
    """One blocking broadcast from rank 0 (small control messages)."""
    _wait(_start(group, buf, what), what)


def broadcast_buckets(group, buckets, on_arrival=None) -> None:
    """Broadcast a sequence of (buffer, label) pairs, double-buffered: bucket b+1 is packed (sender) or
    posted (receiver) while bucket b is on the wire, so at most two buckets are alive at a time.
    `on_arrival(b, buf)` runs on each completed bucket in order (the receiver unpacks there)."""
    pending = None  # (index, work, buf, label) of the bucket in flight
    try:
        for b, (buf, label) in enumerate(buckets):
            work = _start(group, buf, label)
            if pending is not None:
                _finish(pending, on_arrival)
            pending = (b, work, buf, label)
        if pending is not None:
            _finish(pending, on_arrival)
            pending = None
    finally:
        if pending is not None:  # an error with a bucket still posted: let it end before its buffer goes
            try:
                pending[1].wait()
            except RuntimeError:
                pass


def _finish(pending, on_arrival) -> None:
    b, work, buf, label = pending
    _wait(work, label)
    if on_arrival is not None:
        on_arrival(b, buf)


class BroadcastSender(Sender):
    def __init__(
        self,
        n_receivers: int,
        backend: str = "gloo",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        addr: str | None = None,
        local_rank: int = 0,
        port: int | None = None,
    ):
        self.world = n_receivers + 1
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.addr = addr or os.environ.get("WEIGHTSYNC_MASTER_ADDR", "127.0.0.1")
        self.port = port  # an existing store to join (torchrun's); None: host a new one
        self.device = device_for(backend, local_rank)
        self._group = None
        self._join: threading.Thread | None = None
        self._join_error: BaseException | None = None
        self._prepared: tuple[Manifest, Mapping[str, torch.Tensor]] | None = None

    def init(self) -> JSON:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.port is None:
            store = dist.TCPStore(
                self.addr, 0, self.world, is_master=True, timeout=timeout, wait_for_workers=False
            )
        else:
            store = dist.TCPStore(self.addr, self.port, self.world, is_master=False, timeout=timeout)
        self._store = store

        def join() -> None:  # forming the group is collective: it completes once every rank joined
            try:
                self._group = make_group(
                    self.backend, self.addr, store.port, 0, self.world, self.timeout_s, store
                )
            except BaseException as exc:  # noqa: BLE001 - surfaced by transmit()
                self._join_error = exc

        self._join = threading.Thread(target=join, name="broadcast-join", daemon=True)
        self._join.start()
        return {
            "master_addr": self.addr,
            "master_port": self.port or store.port,
            "world_size": self.world,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
        }

    @property
    def store_port(self) -> int | None:
        """The port of the store the group was formed at (None before init)."""
        store = getattr(self, "_store", None)
        return None if store is None else store.port

    def _wait_group(self):
        if self._join is not None:
            self._join.join(self.timeout_s)
            if self._join.is_alive():
                raise TransferError(
                    f"receivers did not join the {self.backend} group within {self.timeout_s}s"
                )
            self._join = None
        if self._join_error is not None:
            raise TransferError(f"forming the {self.backend} group failed: {self._join_error}")
        if self._group is None:
            raise TransferError("broadcast sender not initialised; call init()")
        return self._group

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        manifest = Manifest.build(version, named_tensors, self.bucket_bytes)
        self._prepared = (manifest, named_tensors)
        return {"manifest": manifest.to_json()}

    def group(self):
        """The process group once every rank joined (also usable for small control messages)."""
        return self._wait_group()

    def transmit(self) -> None:
        if self._prepared is None:
            raise TransferError("transmit() without prepare()")
        manifest, tensors = self._prepared
        self._prepared = None
        group = self._wait_group()
        n = len(manifest.bucket_sizes)
        failure: list[tuple[int, BaseException]] = []

        spare: list[
            torch.Tensor
        ] = []  # two pack buffers, reused: bucket b is packed while b-1 is on the wire
        packed = itertools.count()

        def bucket(b: int, size: int) -> torch.Tensor:
            entries = manifest.bucket_entries(b)
            t = tensors[entries[0].name] if len(entries) == 1 else None
            if (
                self.tap is None
                and t is not None
                and entries[0].nbytes == size
                and t.device == self.device
                and t.is_contiguous()
            ):
                return as_bytes(t)  # a bucket that is one whole tensor goes on the wire as it is: no copy
            slot = next(packed) % 2
            if len(spare) <= slot:
                spare.append(torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device))
            out = (
                spare[slot][:size]
                if spare[slot].numel() >= size
                else torch.empty(size, dtype=torch.uint8, device=self.device)
            )
            return manifest.pack_bucket(b, tensors, out=out)

        def buckets():
            for b, size in enumerate(manifest.bucket_sizes):
                buf = None
                if not failure:
                    try:
                        buf = bucket(b, size)
                        if self.tap is not None:
                            apply_cut(self.tap(b, buf, None), buf)  # a collective moves whole buckets
                    except Exception as exc:  # noqa: BLE001 - the trainer failed; re-raised after the trailer
                        failure.append((b, exc))
                if buf is None:  # filler keeps every rank in step; the trailer tells them to drop it
                    buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
                yield buf, f"version {manifest.version} bucket {b}/{n}"

        broadcast_buckets(group, buckets())
        trailer = torch.tensor([ABANDONED, failure[0][0]] if failure else [COMPLETE, n], dtype=torch.int64)
        broadcast_one(group, trailer.to(self.device), f"version {manifest.version} trailer")
        if failure:
            raise failure[0][1]

    def shutdown(self) -> None:
        self._group = None


class BroadcastReceiver(StagingReceiver):
    must_drain = True  # a refusing rank still consumes every bucket, or the collective would hang

    def __init__(self, engine):
        super().__init__(engine)
        self._group = None
        self.device = torch.device("cpu")

    def _init(self, init_info: JSON) -> None:
        try:
            backend = init_info.get("backend", "gloo")
            rank, world = int(init_info["rank"]), int(init_info["world_size"])
            self.device = device_for(backend, int(init_info.get("local_rank", rank)))
            self._group = make_group(
                backend,
                str(init_info["master_addr"]),
                int(init_info["master_port"]),
                rank,
                world,
                float(init_info.get("timeout_s", DEFAULT_TIMEOUT_S)),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ManifestMismatch(f"bad init_info for broadcast: {type(exc).__name__}: {exc}") from None
        except RuntimeError as exc:
            raise TransferError(f"joining the broadcast group failed: {exc}") from None

    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        if self._group is None:
            raise TransferError("broadcast receiver has no group; init_transfer_engine first")
        out: dict[str, torch.Tensor] = {}
        mismatch: list[ManifestMismatch] = []  # raised after the trailer: a collective is drained to its end
        n = len(manifest.bucket_sizes)

        def arrived(b: int, buf: torch.Tensor) -> None:
            try:
                out.update(self._unpack(manifest, b, buf))
            except ManifestMismatch as exc:
                mismatch.append(exc)

        broadcast_buckets(
            self._group,
            (
                (
                    self._bucket_buffer(size),
                    f"version {manifest.version} bucket {b}/{n}",
                )
                for b, size in enumerate(manifest.bucket_sizes)
            ),
            lambda b, buf: None if mismatch else arrived(b, buf),
        )
        trailer = torch.zeros(2, dtype=torch.int64, device=self.device)
        broadcast_one(self._group, trailer, f"version {manifest.version} trailer")
        status, bucket = (int(x) for x in trailer.cpu())
        if status != COMPLETE:
            raise TransferError(
                f"version {manifest.version}: the trainer abandoned the transfer at bucket {bucket}/{n} "
                "(it raised); nothing was staged"
            )
        if mismatch:
            raise mismatch[0]
        return out

    def _bucket_buffer(self, size: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.staging.take(size)  # warm pages: a fresh buffer pays a first touch per page
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _unpack(self, manifest: Manifest, b: int, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensors on the host (the engine's memory), digested as each bucket lands while the next
        is on the wire. A host bucket was received into a staging buffer that is the engine's from
        now on: its tensors are views of it (no copy). A bucket that arrived on a GPU is unpacked and
        digested there, in one pass."""
        verified = getattr(self, "verified_in_transfer", None)
        if buf.device.type == "cuda":  # into the engine's memory: its GPU where it has one, else the host
            target = self.engine_device()
            return {n: t.to(target) for n, t in manifest.unpack_bucket(b, buf, verified=verified).items()}
        tensors = manifest.unpack_bucket(b, buf, adopt=True)
        if verified is not None:
            manifest.verify_all(tensors)
            verified.update(tensors)
        return tensors

    def _shutdown(self) -> None:
        self._group = None
