"""The ceilings: the raw transport under each path, measured on the same machine in the same run, so a
path's throughput is judged as a ratio to what the hardware and library give without the harness.

- disk: a file written with fsync, then mapped by every receiver process (the page cache's pages, as
  safetensors reads them);
- gloo / nccl: a bare broadcast of the path's own messages (its bucket plan) to receiver processes;
- memcpy: warm host copies, one per receiver; device-copy / p2p-copy: a copy on the GPU (or GPU to GPU);
- h2d-copy: a copy from pinned host memory to the GPU (a path whose weights are staged in host memory).

A backend declares which bounds it (`Backend.ceiling`); `make_ceiling` builds that one. Each repeat also
gives the *verified* ceiling (`Ceiling.verified_once`): the raw transport plus what a verified sync must
add, the trainer's digest of its bytes and every receiver's digest of what it received, computed by the
harness's own digests (xxh3 over the host's cores, ws64x2 on the GPU; a same-GPU copy and its digest are
one fused pass, so a verified same-GPU sync moves 3N bytes where the copy moves 2N). The throughput
model (harness.throughput_model) judges a path's fitted bandwidth against it.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness import warm
from harness.api import CEILING_KINDS, Backend
from harness.manifest import DEFAULT_BUCKET_BYTES, bucket_plan


# ---------------------------------------------------------------------------- ceilings
class Ceiling:
    """The raw transport under a path, set up once and timed one repeat at a time, so its repeats can
    be interleaved with the path's own (a ceiling taken at another moment measures another machine).

    `src` (the trainer's bytes, cut as its tensors are) and `dst` (one receiver's copy of them) are what
    `verified_once` digests; `receivers` digest one after another where they share the host's cores or
    one GPU, side by side where each has a GPU of its own (`parallel_receivers`)."""

    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    receivers: int = 1
    parallel_receivers: bool = False

    def once(self) -> float:
        raise NotImplementedError

    def verified_once(self) -> tuple[float, float]:
        """One repeat: (the raw transport's time, the verified ceiling's time = raw + the trainer's digest
        + the receivers' digests)."""
        raw = self.once()
        rx = 1 if self.parallel_receivers else self.receivers
        return raw, raw + timed_digest(self.src) + rx * timed_digest(self.dst)

    def close(self) -> None:
        pass


def timed_digest(tensors: list[torch.Tensor]) -> float:
    """Seconds the harness's own digest takes over `tensors` (their results read back to the host, as a
    manifest needs them)."""
    from harness.manifest import digests

    if not tensors:
        return 0.0
    if tensors[0].device.type == "cuda":
        torch.cuda.synchronize(tensors[0].device)
    t0 = time.perf_counter()
    digests(tensors)
    return time.perf_counter() - t0


def cut(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Views of a flat uint8 buffer, one per tensor size (the digest runs per tensor, as a path's does)."""
    out, at = [], 0
    for n in sizes:
        out.append(buf[at : at + n])
        at += n
    return out


class _ReceiverProcs:
    """A ceiling's receivers as spawned processes, as the path's receivers are (threads of the trainer
    measured slower: ~25% for a gloo broadcast, and 3 readers of the page cache lost to 3 rank processes).
    Each runs `target(conn, *args)`: answers "ready" (or an error), then per "go" does its part of one
    repeat and answers "done"; "stop" ends it."""

    def __init__(self, target, args_per_receiver: list[tuple], timeout_s: float = 120.0):
        ctx = warm.context()  # forks of the ranks' warm server: no torch import per receiver
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for k, args in enumerate(args_per_receiver):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=warm.inherit,
                args=(warm.here(), target, child, *args),
                name=f"ceiling-rx{k}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_ready(self) -> None:
        for k in range(len(self.conns)):
            answer = self._answer(k)
            if answer != "ready":
                raise RuntimeError(f"ceiling receiver {k} could not start: {answer}")

    def go(self) -> None:
        for conn in self.conns:
            conn.send("go")

    def wait_done(self) -> None:
        for k in range(len(self.conns)):
            if self._answer(k) != "done":
                raise RuntimeError(f"ceiling receiver {k} failed")

    def _answer(self, k: int):
        if not self.conns[k].poll(self.timeout_s):
            raise RuntimeError(f"ceiling receiver {k} gave no answer within {self.timeout_s:g}s")
        try:
            return self.conns[k].recv()
        except EOFError:
            raise RuntimeError(f"ceiling receiver {k} died ({self.procs[k].exitcode})") from None

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send("stop")
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def _disk_ceiling_reader(conn, paths: list[str], sizes: list[int]) -> None:
    """A reader of the disk ceiling: per "go", every file mapped with every page populated — the page
    cache's pages in this process, no copy. That is how the path's receivers read (safetensors maps
    its files: 64 MiB "loaded" in 0.3 ms, the bytes faulted in as they are verified), and a copy into
    a buffer (readinto: 25 ms per 64 MiB here) is slower than that, so it would be no ceiling."""
    import mmap

    conn.send("ready")
    while conn.recv() == "go":
        for path, n in zip(paths, sizes, strict=True):
            fd = os.open(path, os.O_RDONLY)
            try:
                if n:
                    mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ).close()
            finally:
                os.close(fd)
        conn.send("done")


class DiskCeiling(Ceiling):
    """The same bytes in files of the path's shard size, each written with fsync, then mapped by every
    receiver process at once: 1 write, N reads, the path's file layout without its format or its commit
    protocol."""

    def __init__(
        self,
        size_bytes: int,
        directory: str,
        receivers: int = 1,
        shard_bytes: int = 1 << 40,
        pieces: list[int] | None = None,
    ):
        self.data = os.urandom(min(size_bytes, 1 << 20)) * max(1, size_bytes // (1 << 20))
        self.receivers = receivers
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data else torch.empty(0)
        self.src = cut(flat, _pieces(pieces, len(self.data)))
        self.dst = [t.clone() for t in self.src]  # what a receiver verifies: its own pages
        step = max(1, min(shard_bytes, len(self.data)))
        self.chunks = [memoryview(self.data)[i : i + step] for i in range(0, len(self.data), step)]
        self.paths = [Path(directory) / f"ceiling-{k}.bin" for k in range(len(self.chunks))]
        self._write()  # the readers' files exist before they start
        sizes = [len(c) for c in self.chunks]
        self.readers = _ReceiverProcs(
            _disk_ceiling_reader, [([str(p) for p in self.paths], sizes)] * receivers
        )
        try:
            self.readers.wait_ready()
        except BaseException:
            self.close()
            raise

    def _write(self) -> None:
        for path, chunk in zip(self.paths, self.chunks, strict=True):
            with open(path, "wb") as f:
                f.write(chunk)
                f.flush()
                os.fsync(f.fileno())

    def once(self) -> float:
        t0 = time.perf_counter()
        self._write()
        self.readers.go()
        self.readers.wait_done()
        return time.perf_counter() - t0

    def close(self) -> None:
        if hasattr(self, "readers"):
            self.readers.close()
        for path in self.paths:
            path.unlink(missing_ok=True)


def _collective_group(backend: str, store, rank: int, world: int, timeout_s: float):
    """A process group of the ceiling's own (prefixed keys), and the device its buffers live on: the
    path's group maker and rank-to-GPU rule (harness.paths.broadcast), so NCCL's rank r sits on GPU r."""
    from harness.paths.broadcast import device_for, make_group

    device = device_for(backend, rank)
    prefixed = dist.PrefixStore("ceiling/", store)
    return make_group(backend, "127.0.0.1", 0, rank, world, timeout_s, store=prefixed), device


def _collective_ceiling_rank(
    conn, port: int, rank: int, world: int, sizes: list[int], timeout_s: float, backend: str = "gloo"
) -> None:
    """A receiver of the broadcast ceiling: join, then one broadcast of every bucket per "go"."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        group, device = _collective_group(backend, store, rank, world, timeout_s)
        # warm: the path stages in warm memory
        bufs = [torch.ones(n, dtype=torch.uint8, device=device) for n in sizes]
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    while conn.recv() == "go":
        for b in bufs:
            group.broadcast(b, 0).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        conn.send("done")


class CollectiveCeiling(Ceiling):
    """A bare torch.distributed broadcast (gloo on CPUs, NCCL on GPUs) of messages of `sizes` bytes from
    this process to `receivers` spawned processes (groups kept across repeats). NCCL places rank r on
    GPU r, as the path does; gloo runs the same code on the host, which is how CI tests it."""

    def __init__(self, sizes: list[int], receivers: int, timeout_s: float = 120.0, backend: str = "gloo"):
        world = receivers + 1
        self.backend = backend
        self.receivers = receivers
        self.parallel_receivers = backend == "nccl"  # a GPU per rank: each verifies on its own
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self.ranks = _ReceiverProcs(
            _collective_ceiling_rank,
            [(self._store.port, r, world, sizes, timeout_s, backend) for r in range(1, world)],
            timeout_s,
        )
        try:
            self.group, self.device = _collective_group(backend, self._store, 0, world, timeout_s)
            self.ranks.wait_ready()
            self.bufs = [torch.ones(n, dtype=torch.uint8, device=self.device) for n in sizes]
            self.src = self.bufs  # a bucket is digested as one piece, as the path verifies a bucket
            self.dst = [torch.ones_like(b) for b in self.bufs]
        except BaseException:
            self.close()
            raise

    def once(self) -> float:
        self.ranks.go()
        t0 = time.perf_counter()
        for b in self.bufs:
            self.group.broadcast(b, 0).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ranks.wait_done()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ranks.close()


class MemcpyCeiling(Ceiling):
    """Warm copies of the payload's bytes in this process, one per receiver at once (every engine gets
    its own copy; they share the host's cores and memory bandwidth as the receivers do)."""

    def __init__(self, size_bytes: int, receivers: int = 1, pieces: list[int] | None = None):
        self.buf = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8)
        self.copies = [torch.empty_like(self.buf) for _ in range(receivers)]
        self.receivers = receivers
        self.src = cut(self.buf, _pieces(pieces, size_bytes))
        self.dst = cut(self.copies[0], _pieces(pieces, size_bytes))
        self.pool = cf.ThreadPoolExecutor(receivers) if receivers > 1 else None
        self.once()

    def _copy(self, k: int) -> None:
        self.copies[k].copy_(self.buf)

    def once(self) -> float:
        t0 = time.perf_counter()
        if self.pool is None:
            self._copy(0)
        else:
            list(self.pool.map(self._copy, range(len(self.copies))))
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


class DeviceCopyCeiling(Ceiling):
    """Copies of the payload's bytes on GPUs: from the trainer's device to each receiver's (the same GPU:
    a device-to-device copy, what same-GPU CUDA IPC bounds on; another GPU: a peer copy). The copies of
    several receivers run one after another on the source GPU's stream, as the receivers share it. Timed
    on the host around a synchronize, as the path's lifecycle is."""

    def __init__(
        self,
        size_bytes: int,
        receivers: int = 1,
        device: str = "cuda:0",
        peers: bool = False,
        pieces: list[int] | None = None,
    ):
        src = torch.device(device)
        n = torch.cuda.device_count()
        if peers and n < 1 + receivers:
            raise ValueError(
                f"a peer-copy ceiling for {receivers} receiver(s) needs {1 + receivers} GPUs, have {n}"
            )
        targets = [torch.device("cuda", (src.index + 1 + k) % n) if peers else src for k in range(receivers)]
        self.buf = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8, device=src)  # the trainer's
        self.source = self.buf  # what each receiver's copy reads (h2d-copy: a pinned host buffer)
        self.copies = [torch.empty(size_bytes, dtype=torch.uint8, device=t) for t in targets]
        self.receivers, self.parallel_receivers = receivers, peers
        self.src = cut(self.buf, _pieces(pieces, size_bytes))
        self.dst = cut(self.copies[0], _pieces(pieces, size_bytes))
        self.once()

    def once(self) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d in self.copies:
            d.copy_(self.source, non_blocking=True)
        for d in {d.device for d in self.copies}:
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    def verified_once(self) -> tuple[float, float]:
        """The same GPU: the trainer's digest (N read) and each receiver's copy-and-digest in one fused
        pass (N read, N written) with the kernel the path's receivers use: 3N bytes where the raw copy
        moves 2N, and no raw copy besides. A peer copy: the copy, then each side's digest."""
        from harness import device_digest
        from harness.manifest import digests

        raw = self.once()
        if self.parallel_receivers or not device_digest.copy_kernel_available():
            return super().verified_once()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        digests(self.src)
        for _ in range(self.receivers):
            if device_digest.copy_and_digest_gathered(self.src) is None:
                device_digest.copy_and_digest(self.src)
        torch.cuda.synchronize()
        return raw, time.perf_counter() - t0


class PinnedHostCopyCeiling(DeviceCopyCeiling):
    """A path whose weights are staged in pinned host memory (checkpoint-engine registers them there):
    each receiver's bytes come over the host-to-device link (PCIe: ~55 GB/s on the H200 host, not the
    device copy's 2.1 TB/s). Verified: the trainer's digest on its GPU, each receiver's digest of its copy."""

    def __init__(
        self, size_bytes: int, receivers: int = 1, device: str = "cuda:0", pieces: list[int] | None = None
    ):
        super().__init__(size_bytes, receivers, device, peers=False, pieces=pieces)
        self.source = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8).pin_memory()
        self.once()

    def verified_once(self) -> tuple[float, float]:
        """The copy over the link, then each side's digest (no fused copy: the bytes start on the host)."""
        return Ceiling.verified_once(self)


def _pieces(pieces: list[int] | None, total: int) -> list[int]:
    """The tensor sizes a ceiling's bytes are digested in: the payload's (fitted to the bytes the ceiling
    holds), else one piece."""
    if not pieces or sum(pieces) != total:
        return [total]
    return pieces


def ceiling_kind(backend: Backend) -> str | None:
    """Which raw transport bounds a backend: what it declares (`Backend.ceiling`, one of
    harness.api.CEILING_KINDS; a subclass of a built-in path inherits its base's), None where it declares
    none (its rows then say "no ceiling" and are not gated)."""
    declared = getattr(backend, "ceiling", None)
    if declared is not None and declared not in CEILING_KINDS:
        raise ValueError(
            f"backend {backend.name!r} declares ceiling {declared!r}; expected one of {CEILING_KINDS}"
        )
    return declared


def make_ceiling(
    backend: Backend,
    weights: dict[str, torch.Tensor],
    receivers: int,
    workdir: str,
    bucket_bytes: int | None = None,
) -> Ceiling | None:
    """The raw transport under the path: file write+read, bare gloo broadcast, or memcpy. The gloo
    ceiling broadcasts the messages the path puts on the wire: its bucket plan for these tensors (a
    tensor larger than a bucket goes whole), not the payload cut at bucket_bytes (64 messages of 1 MiB
    took 52 ms where the path's 8 of 8 MiB take 20: a ceiling the path beats is no ceiling).
    `bucket_bytes`: the unit the path was deployed with, where it is not the backend's own."""
    pieces = [t.numel() * t.element_size() for t in weights.values()]
    nbytes = sum(pieces)
    kind = ceiling_kind(backend)
    if kind == "disk":
        shard_bytes = bucket_bytes or getattr(backend, "shard_bytes", 1 << 40)
        return DiskCeiling(nbytes, workdir, receivers, shard_bytes, pieces)
    if kind in ("gloo", "nccl"):
        bucket_bytes = bucket_bytes or getattr(backend, "bucket_bytes", None) or DEFAULT_BUCKET_BYTES
        _, sizes = bucket_plan((t.numel() * t.element_size() for t in weights.values()), bucket_bytes)
        return CollectiveCeiling(sizes, receivers, backend=kind)
    device = next((str(t.device) for t in weights.values() if t.device.type == "cuda"), "cuda:0")
    if kind in ("device-copy", "p2p-copy"):
        return DeviceCopyCeiling(nbytes, receivers, device, peers=kind == "p2p-copy", pieces=pieces)
    if kind == "h2d-copy":
        return PinnedHostCopyCeiling(nbytes, receivers, device, pieces)
    if kind == "memcpy":
        return MemcpyCeiling(nbytes, receivers, pieces)
    return None
