"""The collocated path: the engine maps the trainer's buffer instead of receiving a copy over a socket.

CPU: POSIX shared memory (/dev/shm), one segment per bucket. CUDA: CUDA IPC handles of the trainer's
own storages, read in place where every tensor allows it (same GPU: one copy, digested in the same pass,
nothing packed), else of one device buffer per bucket (same GPU or a peer GPU). Only metadata crosses the control channel, as JSON:
segment names or IPC handles (bytes, base64), sizes and a per-sync token. The token is written at
the head of every buffer, so a receiver given a stale handle (released) or a foreign one (another
sync's, or anyone else's) gets a clear error instead of someone else's bytes.

Segments are kept across syncs (one per bucket, reused while its size fits and its name still leads to
it: another process may remove or replace a /dev/shm file between syncs): writing into pages that
are already backed is a warm copy, where a new segment costs a reservation and a first touch of every
page, twice the copy on a small host. complete() wipes every token, after every sync, committed or
not, so a handle is good for one sync only; shutdown() (and a size change) unlinks them.
"""

from __future__ import annotations

import base64
import logging
import mmap
import os
import secrets
from collections.abc import Mapping
from multiprocessing import shared_memory

import torch

from harness import phases
from harness.api import (
    JSON,
    ManifestMismatch,
    Sender,
    TransferError,
)
from harness.manifest import Manifest
from harness.paths.base import StagingReceiver
from harness.procs import pid_alive

log = logging.getLogger("weightsync.ipc")
TOKEN_BYTES = 16  # every buffer starts with the sync's token; payload follows
SEGMENT_PREFIX = "wsync-"
DEFAULT_BUCKET_BYTES = 256 << 20


def _map_segment(name: str) -> mmap.mmap:
    """Map an existing segment read-only (copy-on-write) by its /dev/shm path, for one sync: no mapping
    outlives the sync that named it (a kept one would pin a released segment's memory in the engine).

    Not through SharedMemory: before Python 3.13 attaching registers the segment with the resource
    tracker that spawned ranks share with the trainer, which then unlinks or double-unregisters it."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name:
        raise TransferError(f"{name!r} is not a weightsync shared-memory segment name: foreign handle")
    try:
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
    except FileNotFoundError:
        raise TransferError(
            f"shared-memory segment {name!r} does not exist in /dev/shm: removed by another process while "
            "its sync was open (the trainer unlinks a segment only at shutdown or when a bucket's size "
            "changes), or a handle of a sync long over"
        ) from None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def cuda_handle(buf: torch.Tensor | torch.UntypedStorage) -> JSON:
    """JSON-able CUDA IPC handle of a device buffer's storage (or of a storage)."""
    storage = buf if isinstance(buf, torch.UntypedStorage) else buf.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    b64 = lambda b: base64.b64encode(b).decode() if b else None  # noqa: E731
    return {
        "device": device,
        "handle": b64(handle),
        "size": size,
        "offset": offset,
        "ref_handle": b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": b64(event_handle),
        "event_sync": event_sync,
    }


def open_cuda_handle(h: JSON) -> torch.Tensor:
    unb64 = lambda s: base64.b64decode(s) if s else b""  # noqa: E731
    torch.cuda.init()  # opening a handle in a process that has not touched CUDA yet crashes it
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            h["device"],
            unb64(h["handle"]),
            h["size"],
            h["offset"],
            unb64(h["ref_handle"]),
            h["ref_offset"],
            unb64(h["event_handle"]),
            h["event_sync"],
        )
    except (RuntimeError, KeyError, TypeError) as exc:
        raise TransferError(
            f"cannot open CUDA IPC handle (foreign or stale handle?): {type(exc).__name__}: {exc}"
        ) from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h['device']}").set_(storage)


def reuse_handles_enabled() -> bool:
    """Whether CUDA IPC handles are kept across syncs (WEIGHTSYNC_IPC_REUSE_HANDLES=0: opened anew)."""
    return os.environ.get("WEIGHTSYNC_IPC_REUSE_HANDLES", "1") != "0"


def _held_or_opened(held: dict[tuple, torch.Tensor], h: JSON) -> torch.Tensor:
    # `held.get(k) or open(...)` would ask a mapped tensor for its truth value
    mapped = held.get(_handle_key(h))
    return open_cuda_handle(h) if mapped is None else mapped


def _handle_key(h: JSON) -> tuple:
    """What names one mapping: the allocation's handle and where the storage lies in it."""
    return (h.get("device"), h.get("handle"), h.get("offset"), h.get("size"))


def _reserve(shm: shared_memory.SharedMemory, name: str) -> None:
    """Back every page of a new segment now: on a full /dev/shm this raises, where writing into a
    sparse mapping would kill the trainer with SIGBUS."""
    try:
        os.posix_fallocate(shm._fd, 0, shm.size)
    except OSError as exc:
        raise TransferError(
            f"cannot reserve {shm.size} bytes of shared memory for segment {name}: {exc.strerror or exc} "
            f"(errno {exc.errno}; /dev/shm full?); nothing was sent"
        ) from exc


class IpcSender(Sender):
    def __init__(self, device: str = "cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self._segments: list[shared_memory.SharedMemory] = []  # bucket b's segment, kept across syncs
        self._cuda_buffers: list[torch.Tensor] = []
        self._token: torch.Tensor | None = None  # in place: the sync's token, on the GPU, kept across syncs
        self._shared: list[torch.UntypedStorage] = []  # in place: the trainer's storages, held until complete
        # in place: each storage's handle, kept across syncs while the storage is (held here, so its memory is
        # never another storage's): a trainer's weights are updated in place, so the next sync shares the same
        # storages, and sharing one again costs a new IPC event and ref-count slot here and their opening in
        # every receiver (WEIGHTSYNC_IPC_REUSE_HANDLES=0: shared anew every sync, as before)
        self._handles: dict[tuple[int, int], tuple[torch.UntypedStorage, JSON]] = {}
        self._token_handle: JSON | None = None
        self.reuse_handles = reuse_handles_enabled()
        #: what happened to kept segments between syncs, by another process (newest last): diagnose() says it
        self.damaged: list[str] = []

    def init(self) -> JSON:
        sweep_abandoned_segments()  # a trainer killed mid-sync left its segments in /dev/shm (RAM)
        return {"kind": "cuda" if self.device.type == "cuda" else "shm"}

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        self.complete(False)  # a prepare that was never completed must not leave a valid token behind
        manifest = Manifest.build(version, named_tensors, self.bucket_bytes)
        token = secrets.token_bytes(TOKEN_BYTES)
        token_t = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        in_place = self._in_place(manifest, named_tensors, token_t) if self.device.type == "cuda" else None
        if in_place is not None:
            return {"manifest": manifest.to_json(), "token": token.hex(), "buffers": [], "in_place": in_place}
        buffers = []
        if self.device.type != "cuda":
            self._fit_segments(manifest.bucket_sizes)
        for b, size in enumerate(manifest.bucket_sizes):
            if self.device.type == "cuda":
                buf = torch.empty(TOKEN_BYTES + size, dtype=torch.uint8, device=self.device)
                buf[:TOKEN_BYTES].copy_(token_t)
                manifest.pack_bucket(b, named_tensors, out=buf[TOKEN_BYTES:])
                self._cuda_buffers.append(buf)
                buffers.append({"cuda": cuda_handle(buf), "size": size})
            else:
                shm = self._segments[b]
                view = torch.frombuffer(shm.buf, dtype=torch.uint8)
                manifest.pack_bucket(b, named_tensors, out=view[TOKEN_BYTES:])  # packed in place: one copy
                keep = self.tap(b, view[TOKEN_BYTES:], shm.name) if self.tap is not None else None
                view[:TOKEN_BYTES].copy_(
                    token_t
                )  # last: a receiver never sees this sync's token on a half-packed bucket
                del view  # no exported pointer may outlive the mapping
                if keep is not None and 0 <= keep < size:
                    os.ftruncate(shm._fd, TOKEN_BYTES + keep)
                buffers.append({"shm": shm.name, "size": size})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"manifest": manifest.to_json(), "token": token.hex(), "buffers": buffers}

    def _in_place(self, manifest: Manifest, named_tensors, token_t: torch.Tensor) -> JSON | None:
        """Same-GPU zero copy: the trainer's own storages are shared as they are, and each receiver copies
        (and digests, in the same pass) every tensor straight out of them into its engine's memory, so
        nothing is packed. Only where every tensor is a non-empty contiguous run of whole 4-byte words on
        this GPU, 16-byte aligned in its storage (the copy kernel's wide accesses); else None: packed.
        The token lives in a small buffer of its own, written last and wiped by complete(): a handle of
        this sync opens after it, but reads as stale."""
        storages: list[torch.UntypedStorage] = []
        index: dict[int, int] = {}
        placed = []
        for e in manifest.entries:
            t = named_tensors[e.name]
            offset = t.storage_offset() * t.element_size()
            storage = t.untyped_storage()
            if (
                t.device != self.device
                or not e.nbytes
                or e.nbytes % 4
                or not t.is_contiguous()
                or offset % 16
                or storage.data_ptr() % 16
            ):
                return None
            k = index.setdefault(storage.data_ptr(), len(storages))
            if k == len(storages):
                storages.append(storage)
            placed.append([k, offset])
        if self._token is None:
            self._token = torch.zeros(TOKEN_BYTES, dtype=torch.uint8, device=self.device)
            self._token_handle = cuda_handle(self._token)
        self._shared = storages  # none may be freed while a receiver maps it
        token_handle = self._token_handle if self.reuse_handles else cuda_handle(self._token)
        refs = {"token": token_handle, "storages": self._handles_of(storages)}
        self._token.copy_(token_t)
        torch.cuda.synchronize(self.device)  # the digests, and the token, are there before any receiver looks
        return {**refs, "tensors": placed}

    def _handles_of(self, storages: list[torch.UntypedStorage]) -> list[JSON]:
        """Each storage's handle: the one it was shared with before where it is still the storage kept for
        that address and size, else shared now. Storages this sync does not name are let go."""
        if not self.reuse_handles:
            return [cuda_handle(st) for st in storages]
        kept = {}
        for st in storages:
            key = (st.data_ptr(), st.nbytes())
            kept[key] = self._handles.get(key) or (st, cuda_handle(st))
        self._handles = kept
        return [kept[(st.data_ptr(), st.nbytes())][1] for st in storages]

    def _fit_segments(self, sizes) -> None:
        """One segment of exactly TOKEN_BYTES + size per bucket: kept where it fits and its name still
        leads to it, new where not."""
        for b, size in enumerate(sizes):
            damage = _damage(self._segments[b]) if b < len(self._segments) else None
            if damage:  # removed from /dev/shm, or the name taken by another file: made anew
                self.damaged = [*self.damaged[-15:], f"bucket {b}: {damage}"]
                log.warning("ipc sender: bucket %d: %s; made anew (RemoveIPC=yes in logind.conf?)", b, damage)
                _abandon(self._segments[b])
            elif b < len(self._segments) and os.fstat(self._segments[b]._fd).st_size == TOKEN_BYTES + size:
                continue
            with phases.phase("alloc"):
                if b < len(self._segments) and not damage:
                    _release(self._segments[b])
                name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
                shm = shared_memory.SharedMemory(name=name, create=True, size=TOKEN_BYTES + size)
                try:
                    _reserve(shm, name)
                except BaseException:  # nothing is kept from a sync that could not reserve its memory
                    _release(shm)
                    for kept in self._segments[:b] + self._segments[b + 1 :]:
                        _release(kept)
                    self._segments.clear()
                    raise
                if b < len(self._segments):
                    self._segments[b] = shm
                else:
                    self._segments.append(shm)
        for shm in self._segments[len(sizes) :]:
            _release(shm)
        del self._segments[len(sizes) :]

    def transmit(self) -> None:
        """Nothing moves: the bytes already sit in memory the receivers map."""

    def complete(self, committed: bool) -> None:
        # Wipe every token: a handle of this sync is stale from now on. CUDA's caching allocator keeps
        # a freed block mapped and intact, so a stale CUDA handle would still open: wipe, then free.
        for buf in self._cuda_buffers:
            buf[:TOKEN_BYTES].zero_()
        if self._token is not None:
            self._token.zero_()
        if self._cuda_buffers or self._token is not None:
            torch.cuda.synchronize(self.device)
        self._cuda_buffers.clear()
        self._shared = []
        for shm in self._segments:
            if os.fstat(shm._fd).st_size >= TOKEN_BYTES:
                shm.buf[:TOKEN_BYTES] = bytes(TOKEN_BYTES)

    def diagnose(self) -> list[str]:
        """After a failed sync: what another process did to this sync's segments while it was open."""
        return [f"bucket {b}: {d}" for b, shm in enumerate(self._segments) if (d := _damage(shm))]

    def shutdown(self) -> None:
        self.complete(False)
        self._handles.clear()
        for shm in self._segments:
            _release(shm)  # a segment whose name is gone or taken is abandoned, not unlinked
        self._segments.clear()


def _damage(shm: shared_memory.SharedMemory) -> str | None:
    """What another process did to a kept segment since it was made (None: its name still leads to it).
    The sender's descriptor keeps the memory alive whatever happens to the name, so a size check alone
    would go on packing into a file no receiver can open: systemd-logind's RemoveIPC unlinks a user's
    segments when their last session ends; anyone may unlink or replace a /dev/shm file."""
    path = f"/dev/shm/{shm.name.lstrip('/')}"
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return f"segment {shm.name} was removed from /dev/shm by another process"
    own = os.fstat(shm._fd)
    if (named.st_dev, named.st_ino) != (own.st_dev, own.st_ino):
        return f"segment {shm.name} in /dev/shm was replaced by another process's file (inode {named.st_ino}, ours {own.st_ino})"
    return None


def _abandon(shm: shared_memory.SharedMemory) -> None:
    """Let go of a segment whose name is gone or leads to a file not ours: close, never unlink, and take
    it off the resource tracker's list (which would unlink that name when the trainer exits)."""
    from multiprocessing import resource_tracker

    shm.close()
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001, S110 - a tracker that never knew it has nothing to forget
        pass


def _release(shm: shared_memory.SharedMemory) -> None:
    """Close and unlink a segment of ours; where its name no longer leads to it (removed, or another
    process's file took it) the name is not ours to unlink: abandoned instead. (A bucket dropped when
    a patch needed fewer, or a size change, used to unlink a foreign file by the name.)"""
    if _damage(shm):
        _abandon(shm)
        return
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class IpcReceiver(StagingReceiver):
    fuse_verify = True  # on a GPU: digest while copying out (False: copy, then verify in a second pass)

    def __init__(self, engine, device: str | None = None):
        super().__init__(engine)
        self.device = device  # None: the engine's own (engine.device), else the host
        # The trainer's storages mapped by the last sync, held until the next one has opened its own: a
        # handle still mapped opens as a lookup (torch keeps one mapping per handle while it is used)
        # instead of a fresh cudaIpcOpenMemHandle. (Not measured without it; with it, opening a sync's
        # 9 handles took 0.4 ms on one H200, 2026-12-03.)
        self._held_mappings: dict[tuple, torch.Tensor] = {}  # by what names each (_handle_key)

    def engine_device(self) -> torch.device:
        """The device this receiver was given, else the engine's own."""
        return torch.device(self.device) if self.device else super().engine_device()

    def _init(self, init_info: JSON) -> None:
        if init_info.get("kind") not in ("shm", "cuda"):
            raise ManifestMismatch(f"ipc init_info needs kind 'shm' or 'cuda', got {init_info.get('kind')!r}")

    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        try:
            token = bytes.fromhex(update_info["token"])
            buffers = list(update_info["buffers"])
        except (KeyError, ValueError, TypeError) as exc:
            raise ManifestMismatch(f"ipc update_info needs 'token' and 'buffers': {exc}") from None
        if "in_place" in update_info:
            return self._read_in_place(manifest, update_info["in_place"], token)
        if len(buffers) != len(manifest.bucket_sizes):
            raise ManifestMismatch(f"{len(buffers)} buffers for {len(manifest.bucket_sizes)} buckets")
        out: dict[str, torch.Tensor] = {}
        for b, ref in enumerate(buffers):
            out.update(self._read_bucket(manifest, b, ref, token))
        return out

    def _read_bucket(self, manifest: Manifest, b: int, ref: JSON, token: bytes) -> dict[str, torch.Tensor]:
        size = manifest.bucket_sizes[b]
        if "cuda" in ref:
            buf = open_cuda_handle(ref["cuda"])
            if buf.numel() < TOKEN_BYTES + size:
                raise TransferError(
                    f"CUDA buffer of bucket {b} holds {buf.numel()} bytes, expected {TOKEN_BYTES + size}"
                )
            head = bytes(buf[:TOKEN_BYTES].cpu().numpy())
            self._check_token(head, token, f"CUDA buffer of bucket {b}")
            # unpack (and digest) on the GPU that holds the bytes, then move to the receiver's device (a GPU
            # engine's, or host memory for a CPU engine): the digest never runs on the host
            tensors = manifest.unpack_bucket(
                b, buf[TOKEN_BYTES : TOKEN_BYTES + size], verified=self._fused_verified()
            )
            target = self.engine_device()
            return {n: t.to(target) for n, t in tensors.items()}
        name = str(ref.get("shm"))
        mapping = _map_segment(name)
        try:
            view = torch.frombuffer(mapping, dtype=torch.uint8)
            try:
                if view.numel() < TOKEN_BYTES + size:
                    raise TransferError(
                        f"segment {name} holds {view.numel()} bytes, expected {TOKEN_BYTES + size}"
                    )
                self._check_token(bytes(view[:TOKEN_BYTES].numpy()), token, f"segment {name}")
                # copied out (the next sync rewrites the segment) into warm staging memory the engine takes
                with phases.phase("unpack"):
                    staged = self.staging.take(size)
                    staged.copy_(view[TOKEN_BYTES : TOKEN_BYTES + size])
                return manifest.unpack_bucket(b, staged, adopt=True)
            finally:
                del view
        finally:
            mapping.close()

    def _read_in_place(self, manifest: Manifest, ref: JSON, token: bytes) -> dict[str, torch.Tensor]:
        """Copy every tensor out of the trainer's own storages (IpcSender._in_place), digesting as it goes."""
        try:
            token_handle, storages = ref["token"], list(ref["storages"])
            placed = [(int(k), int(at)) for k, at in ref["tensors"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestMismatch(
                f"ipc in-place update_info needs 'token', 'storages', 'tensors': {exc}"
            ) from None
        if len(placed) != len(manifest.entries):
            raise ManifestMismatch(f"{len(placed)} placements for {len(manifest.entries)} tensors")
        with phases.phase("open"):
            # a handle the last sync mapped is still mapped here: taken as it is (the sender shares a storage
            # once while it keeps it; its memory stays the trainer's while a receiver holds the mapping)
            held = self._held_mappings if reuse_handles_enabled() else {}
            head = _held_or_opened(held, token_handle)
            if head.numel() < TOKEN_BYTES:
                raise TransferError(f"CUDA token buffer holds {head.numel()} bytes, expected {TOKEN_BYTES}")
            self._check_token(bytes(head[:TOKEN_BYTES].cpu().numpy()), token, "CUDA token buffer")
            mapped = [_held_or_opened(held, h) for h in storages]
        for e, (k, at) in zip(manifest.entries, placed, strict=True):
            if not 0 <= k < len(mapped) or at < 0 or at + e.nbytes > mapped[k].numel():
                raise TransferError(
                    f"version {manifest.version}: tensor {e.name!r} ({e.nbytes} bytes at {at} of storage {k}) "
                    "lies outside the storages shared"
                )
        self._held_mappings = {
            _handle_key(h): t for h, t in zip([token_handle, *storages], [head, *mapped], strict=True)
        }
        target, verified = self.engine_device(), self._fused_verified()
        entries = list(manifest.entries)
        # every tensor of every storage in one launch, one transfer of the sums
        sources = [mapped[k][at : at + e.nbytes] for e, (k, at) in zip(entries, placed, strict=True)]
        gathered = manifest.unpack_gathered(entries, sources, verified) if verified is not None else None
        if gathered is not None:
            return {n: t.to(target) for n, t in gathered.items()}
        groups: dict[int, list] = {}  # else storage by storage
        for e, (k, at) in zip(entries, placed, strict=True):
            groups.setdefault(k, []).append((e, at))
        out = {}
        for k, items in groups.items():
            tensors = manifest.unpack_ranges(
                [e for e, _ in items], [at for _, at in items], mapped[k], verified
            )
            out.update({n: t.to(target) for n, t in tensors.items()})
        return out

    def _shutdown(self) -> None:
        self._held_mappings = {}

    def _fused_verified(self) -> set[str] | None:
        """Where the staged copies are digested while they are made (GPU): the set they go in."""
        return getattr(self, "verified_in_transfer", None) if self.fuse_verify else None

    @staticmethod
    def _check_token(head: bytes, token: bytes, what: str) -> None:
        if head == bytes(TOKEN_BYTES):
            raise TransferError(f"{what} was released by its sync (token wiped): stale handle")
        if head != token:
            raise TransferError(
                f"{what} belongs to another sync (token {head.hex()[:12]}..., expected "
                f"{token.hex()[:12]}...): foreign or stale handle"
            )


def live_segments() -> list[str]:
    """Segments of this harness present in /dev/shm now (for leak checks)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []


def own_segments(pid: int | None = None) -> list[str]:
    """Segments a trainer (this process by default) created and has not released."""
    prefix = f"{SEGMENT_PREFIX}{pid or os.getpid()}-"
    return [n for n in live_segments() if n.startswith(prefix)]


def sweep_abandoned_segments() -> list[str]:
    """Unlink the segments of trainers that died (their pid is gone): a SIGKILLed trainer cannot
    release what it allocated, and its resource tracker may have died with it. Only this user's: on a
    shared host another user's segment is theirs to release (and /dev/shm's sticky bit refuses it)."""
    removed = []
    for name in live_segments():
        pid = name[len(SEGMENT_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        path = f"/dev/shm/{name}"
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
            removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    return removed
