"""Sync throughput, measured beside the ceiling of the same transport on the same machine.

One row per (path, receivers, size), nccl-tests style: time is the median full lifecycle (start,
deliver, finish on every engine), algbw = bytes / time, and #wrong counts tensors that did not arrive
bit for bit (checked in the same run). The ceiling is the raw transport without the harness: file
write + fsync, then mapped by every receiver, for disk; a bare gloo broadcast of the path's own messages (its bucket plan) to
receiver processes for broadcast, warm copies for ipc.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime
import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch
import torch.distributed as dist

from harness import phases
from harness.api import Backend, spec_of
from harness.checks import bitwise_mismatches
from harness.deployment import push
from harness.devices import normalize, run_device
from harness.manifest import DEFAULT_BUCKET_BYTES, bucket_plan

#: Default floors of the throughput gate (ratio to the ceiling), per path on CPU: regression gates set
#: about 30% under the lowest a 2-core CI VM measured at 64 MiB, in the default tier's own run, on the
#: two host types seen (2026-12-02; docs/performance.md, "Floors on CPU"): a host whose memcpy is twice
#: as fast halves ipc's ratio to it, and a VM late in a long run pays page faults and fsync stalls the
#: ceiling's warm repeats do not. A row below its floor, or with #wrong > 0, fails; `weightsync certify
#: --floor PATH=RATIO` / `--weightsync-floor` set one for the hardware at hand.
CPU_FLOORS = {"disk": 0.2, "broadcast": 0.25, "delta": 0.10, "ipc": 0.02, "delta-ipc": 0.008}
GATED_FROM_BYTES = 64 << 20  # below, a fixed cost per sync (RPC, process wake-ups) dominates a 2-core host
#: Floors of a path whose ceiling is a GPU transport (device copy, peer copy, NCCL), by the smallest size
#: they apply from: end to end (start, prepare with digests, transfer, verify, commit, finish) against
#: the ceiling of the same GPU measured in the same run. Delta paths are gated on the dense bytes they
#: deliver (effective bandwidth), as on the CPU. `--floor PATH=RATIO` replaces a path's tiers with one.
GPU_FLOOR_TIERS = ((256 << 20, 0.90), (64 << 20, 0.5))
GPU_CEILINGS = ("device-copy", "p2p-copy", "nccl")
CEILING_REPEATS_PER_PUSH = 2
DEFAULT_CHANGED = 0.01  # delta paths: entries changed per version (bf16 RL steps change about 1%)
#: Parts of a row's critical path, in the order of its stacked bar: the trainer's prepare (digest,
#: alloc, pack), the slowest receiver's transfer (wire, unpack, verify), its commit, and the rest
#: (other: RPC, locks, engine reads, Python between the steps).
BAR_PARTS = ("digest", "alloc", "pack", "wire", "open", "unpack", "verify", "commit", "other")


@dataclasses.dataclass
class SyncRow:
    path: str
    receivers: int
    size_bytes: int
    count: int  # tensors
    dtype: str
    time_s: float
    algbw_gbs: float
    ceiling_gbs: float
    wrong: int
    floor: float = 0.0
    ceiling_kind: str = ""  # which raw transport the ceiling is (Backend.ceiling): device-copy, gloo, ...
    device: str = "cpu"  # where the payload and the engines lived
    changed: float = 0.0  # delta paths: the fraction of entries each new version changes
    bucket_bytes: int | None = None  # the bucket sweep's bucket size; None: the backend's own
    steps: dict[str, float] = dataclasses.field(default_factory=dict)  # start, prepare, transfer, finish
    parts: dict[str, float] = dataclasses.field(default_factory=dict)  # BAR_PARTS of the median repeat
    sender: dict[str, float] = dataclasses.field(
        default_factory=dict
    )  # every sender phase (overlaps included)
    times_s: list[float] = dataclasses.field(default_factory=list)
    ceiling_times_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.algbw_gbs / self.ceiling_gbs if self.ceiling_gbs else 0.0

    @property
    def verdict(self) -> str:
        """ok; wrong (a tensor differed); unreliable (faster than its ceiling: the ceiling was not one);
        below floor; or no ceiling."""
        if self.wrong:
            return "wrong"
        if not self.ceiling_gbs:
            return "no ceiling"
        if self.ratio > 1.0:
            return "unreliable"
        return "ok" if self.ratio >= self.floor else "below floor"

    @property
    def passed(self) -> bool:
        """The gate: nothing wrong, and at or above the floor where the row has one (an unreliable row
        is not a pass: its ceiling was no ceiling)."""
        return not self.wrong and (not self.floor or self.verdict == "ok")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": round(self.ratio, 4), "verdict": self.verdict}


#: The throughput table's columns, as every renderer heads them (the terminal in cli.py, report.md in
#: report.py, report.html in report_html.py); throughput_cells gives a row's text in this order.
THROUGHPUT_COLUMNS = (
    "path",
    "rx",
    "size (B)",
    "count",
    "type",
    "time (ms)",
    "algbw (GB/s)",
    "ceiling (GB/s)",
    "bound",
    "ratio",
    "floor",
    "#wrong",
    "verdict",
)


def throughput_cells(row: SyncRow) -> list[str]:
    """The cells of one throughput row as every renderer shows them (they only style them), one per
    THROUGHPUT_COLUMNS. The verdict cell is SyncRow.verdict (wrong, no ceiling, unreliable, below floor,
    ok), gated or not: a row without a floor shows `–` in the floor column, and `passed` is what gates."""
    return [
        row.path,
        str(row.receivers),
        str(row.size_bytes),
        str(row.count),
        row.dtype,
        f"{row.time_s * 1e3:.2f}",
        f"{row.algbw_gbs:.3f}",
        f"{row.ceiling_gbs:.3f}",
        row.ceiling_kind or "–",
        f"{row.ratio:.2f}",
        f"{row.floor:g}" if row.floor else "–",
        str(row.wrong),
        row.verdict,
    ]


def payload(
    size_bytes: int, n_tensors: int = 8, seed: int = 0, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Seeded bf16 tensors totalling about `size_bytes`, on `device` (the trainer's weights live there;
    a GPU draws them itself: gigabytes drawn on the host would take a minute)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per = max(1, size_bytes // 2 // n_tensors)
    return {
        f"bench.{i}.weight": torch.randn(per, generator=gen, device=device).to(torch.bfloat16)
        for i in range(n_tensors)
    }


# ---------------------------------------------------------------------------- ceilings
class Ceiling:
    """The raw transport under a path, set up once and timed one repeat at a time, so its repeats can
    be interleaved with the path's own (a ceiling taken at another moment measures another machine)."""

    def once(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _ReceiverProcs:
    """A ceiling's receivers as spawned processes, as the path's receivers are (threads of the trainer
    measured slower: ~25% for a gloo broadcast, and 3 readers of the page cache lost to 3 rank processes).
    Each runs `target(conn, *args)`: answers "ready" (or an error), then per "go" does its part of one
    repeat and answers "done"; "stop" ends it."""

    def __init__(self, target, args_per_receiver: list[tuple], timeout_s: float = 120.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for k, args in enumerate(args_per_receiver):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child, *args), name=f"ceiling-rx{k}", daemon=True)
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

    def __init__(self, size_bytes: int, directory: str, receivers: int = 1, shard_bytes: int = 1 << 40):
        self.data = os.urandom(min(size_bytes, 1 << 20)) * max(1, size_bytes // (1 << 20))
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

    def __init__(self, size_bytes: int, receivers: int = 1):
        self.src = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8)
        self.dst = [torch.empty_like(self.src) for _ in range(receivers)]
        self.pool = cf.ThreadPoolExecutor(receivers) if receivers > 1 else None
        self.once()

    def _copy(self, k: int) -> None:
        self.dst[k].copy_(self.src)

    def once(self) -> float:
        t0 = time.perf_counter()
        if self.pool is None:
            self._copy(0)
        else:
            list(self.pool.map(self._copy, range(len(self.dst))))
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


class DeviceCopyCeiling(Ceiling):
    """Copies of the payload's bytes on GPUs: from the trainer's device to each receiver's (the same GPU:
    a device-to-device copy, what same-GPU CUDA IPC bounds on; another GPU: a peer copy). The copies of
    several receivers run one after another on the source GPU's stream, as the receivers share it. Timed
    on the host around a synchronize, as the path's lifecycle is."""

    def __init__(self, size_bytes: int, receivers: int = 1, device: str = "cuda:0", peers: bool = False):
        src = torch.device(device)
        n = torch.cuda.device_count()
        if peers and n < 1 + receivers:
            raise ValueError(
                f"a peer-copy ceiling for {receivers} receiver(s) needs {1 + receivers} GPUs, have {n}"
            )
        targets = [torch.device("cuda", (src.index + 1 + k) % n) if peers else src for k in range(receivers)]
        self.src = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8, device=src)
        self.dst = [torch.empty(size_bytes, dtype=torch.uint8, device=t) for t in targets]
        self.once()

    def once(self) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d in self.dst:
            d.copy_(self.src, non_blocking=True)
        for d in {d.device for d in self.dst}:
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0


def ceiling_kind(backend: Backend) -> str | None:
    """Which raw transport bounds a backend: what it declares (Backend.ceiling), else by what it is built
    on, so a variant of a built-in path (a vendor's broadcast, a broken one in suites/meta) is measured
    against the same ceiling."""
    from harness.api import CEILING_KINDS

    declared = getattr(backend, "ceiling", None)
    if declared is not None:
        if declared not in CEILING_KINDS:
            raise ValueError(
                f"backend {backend.name!r} declares ceiling {declared!r}; expected one of {CEILING_KINDS}"
            )
        return declared
    from harness.backends.broadcast import BroadcastBackend
    from harness.backends.delta import DeltaBackend
    from harness.backends.disk import DiskBackend
    from harness.backends.ipc import IpcBackend

    if isinstance(backend, DeltaBackend):
        return "memcpy" if backend.capabilities.ipc else "gloo"
    if isinstance(backend, BroadcastBackend):
        return "gloo"
    if isinstance(backend, IpcBackend):
        return "memcpy"
    if isinstance(backend, DiskBackend):
        return "disk"
    return {"disk": "disk", "broadcast": "gloo", "delta": "gloo", "ipc": "memcpy", "delta-ipc": "memcpy"}.get(
        backend.name
    )


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
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    kind = ceiling_kind(backend)
    if kind == "disk":
        shard_bytes = bucket_bytes or getattr(backend, "shard_bytes", 1 << 40)
        return DiskCeiling(nbytes, workdir, receivers, shard_bytes)
    if kind in ("gloo", "nccl"):
        bucket_bytes = bucket_bytes or getattr(backend, "bucket_bytes", None) or DEFAULT_BUCKET_BYTES
        _, sizes = bucket_plan((t.numel() * t.element_size() for t in weights.values()), bucket_bytes)
        return CollectiveCeiling(sizes, receivers, backend=kind)
    if kind in ("device-copy", "p2p-copy"):
        device = next((str(t.device) for t in weights.values() if t.device.type == "cuda"), "cuda:0")
        return DeviceCopyCeiling(nbytes, receivers, device, peers=kind == "p2p-copy")
    if kind == "memcpy":
        return MemcpyCeiling(nbytes, receivers)
    return None


def _versions(weights: dict[str, torch.Tensor], fraction: float, n: int):
    """n successive versions, each with `fraction` of every tensor's entries changed (0: the same)."""
    gen = torch.Generator().manual_seed(7)
    current = weights
    for _ in range(n):
        if fraction:
            current = {k: t.clone() for k, t in current.items()}
            for t in current.values():
                idx = torch.randint(0, t.numel(), (max(1, int(fraction * t.numel())),), generator=gen)
                t[idx] = (t[idx].float() + 1).to(t.dtype)
        yield current


def _critical_parts(
    steps: dict[str, float], sender: dict[str, float], receivers: list[dict[str, float]]
) -> dict:
    """The stacked bar of one push: what the trainer did while preparing, what the slowest receiver did
    while the bytes moved, its commit, and the rest as other (see BAR_PARTS)."""
    slowest = max(receivers, key=lambda r: sum(r.values()), default={})
    parts = {p: sender.get(p, 0.0) for p in ("digest", "alloc", "pack")}
    parts.update({p: slowest.get(p, 0.0) for p in ("wire", "open", "unpack", "verify", "commit")})
    parts["wire"] += sender.get("wire", 0.0)  # a path whose trainer writes during prepare (disk)
    parts["other"] = max(0.0, sum(steps.values()) - sum(parts.values()))
    return parts


class SyncBench:
    """One row's measurement, as `weightsync certify` and suites/performance both take it: deploy, push
    once to warm up, then per repeat `before()` (two ceiling repeats, the next version; untimed) and
    `push(weights)` (timed, with its phases); `row()` at the end.

    Delta paths push a new version with `fraction` (default 1%) of entries changed each time (the RL
    regime) and count the dense bytes delivered (effective bandwidth). `bucket_bytes` deploys the path
    with that unit (the ceiling takes the same bucket plan); only a backend that claims `buckets` takes it.
    `n_tensors`: how many tensors the payload is cut into (buckets pack several small ones)."""

    def __init__(
        self,
        backend: Backend,
        size: int,
        receivers: int,
        workdir: str,
        floor: float = 0.0,
        fraction: float | None = None,
        repeats: int = 5,
        engine: str | None = None,
        bucket_bytes: int | None = None,
        n_tensors: int = 8,
    ):
        if bucket_bytes is not None and not backend.capabilities.buckets:
            raise ValueError(
                f"backend {backend.name!r} does not claim the buckets capability: "
                f"it cannot be deployed with bucket_bytes={bucket_bytes}"
            )
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.backend, self.receivers, self.floor, self.engine = backend, receivers, floor, engine
        self.bucket_bytes = bucket_bytes
        self.kind = ceiling_kind(backend)
        # a GPU path's trainer holds its weights on the GPU: the run's, else the backend's own
        self.device = "cpu"
        if self.kind in GPU_CEILINGS:
            self.device = normalize(
                run_device() if run_device() != "cpu" else getattr(backend, "device", None) or "cuda"
            )
        self.weights = payload(size, n_tensors, device=self.device)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.weights.values())
        self.changed = (
            (DEFAULT_CHANGED if fraction is None else fraction) if backend.capabilities.delta else 0.0
        )
        self._versions = _versions(self.weights, self.changed, repeats + 1)
        bucket = f"-b{bucket_bytes}" if bucket_bytes else ""  # rows of a sweep do not share a directory
        self._workdir = str(Path(workdir) / f"{backend.name}-{size}-{receivers}{bucket}")
        self._samples: list[tuple] = []  # (total, laps, sender at prepare, sender, receivers)
        self._ceiling_times: list[float] = []
        self._version = iter(range(1, 1 << 30))
        self.last = self.weights

    def __enter__(self) -> Self:
        self._was_recording = phases.enabled()
        phases.set_enabled(True)  # before deploy: spawned ranks record too
        kwargs = {"engine": self.engine} if self.engine else {}  # None: the backend's own default
        if self.bucket_bytes is not None:  # only then: a backend without buckets may not take the argument
            kwargs["bucket_bytes"] = self.bucket_bytes
        self.deployment = self.backend.deploy(self.receivers, spec_of(self.weights), self._workdir, **kwargs)
        self._take_ranks = getattr(self.deployment, "take_phases", lambda: [])
        try:
            self.ceiling = make_ceiling(
                self.backend, self.weights, self.receivers, self._workdir, self.bucket_bytes
            )
            push(
                self.deployment, next(self._version), self.weights
            )  # warm-up: connections, page cache, allocator
            if self.ceiling is not None:
                self.ceiling.once()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if getattr(self, "ceiling", None) is not None:
                self.ceiling.close()
        finally:
            self.deployment.close()
            phases.set_enabled(self._was_recording)

    def before(self) -> tuple[tuple, dict]:
        """Untimed, before each push: two ceiling repeats, the next version; (args, kwargs) of push()."""
        if self.ceiling is not None:  # two per push: the best of a few is a ceiling, one sample is noise
            self._ceiling_times += [self.ceiling.once() for _ in range(CEILING_REPEATS_PER_PUSH)]
        weights = next(self._versions)
        phases.take()
        self._take_ranks()
        gc.collect()
        return (weights,), {}

    def push(self, weights: dict[str, torch.Tensor]) -> None:
        laps: dict[str, float] = {}
        prepared: dict[str, dict[str, float]] = {}
        gc.disable()  # a collection inside one repeat is the harness's noise, not the path's
        try:
            push(
                self.deployment,
                next(self._version),
                weights,
                timings=laps,
                on_lap=lambda name: prepared.update(phases.take()) if name == "prepare" else None,
            )
        finally:
            gc.enable()
        self.last = weights
        rest = phases.take()
        at_prepare = prepared.get("sender", {})
        sender = {
            k: at_prepare.get(k, 0.0) + rest.get("sender", {}).get(k, 0.0)
            for k in set(at_prepare) | set(rest.get("sender", {}))
        }
        in_process = rest.get("receiver", {})  # receivers that live in this process
        ranks = [r.get("receiver", {}) for r in self._take_ranks()] or ([in_process] if in_process else [])
        self._samples.append((sum(laps.values()), laps, at_prepare, sender, ranks))

    def row(self) -> SyncRow:
        """The median push, its breakdown, the best ceiling repeat, and #wrong read back from every engine."""
        wrong = sum(
            len(bitwise_mismatches(self.last, h.engine.read_weights())) for h in self.deployment.handles
        )
        samples = sorted(self._samples, key=lambda s: s[0])
        total, laps, at_prepare, sender, ranks = samples[len(samples) // 2]
        ceiling = self.nbytes / min(self._ceiling_times) / 1e9 if self._ceiling_times else 0.0
        return SyncRow(
            self.backend.name,
            self.receivers,
            self.nbytes,
            len(self.weights),
            "bf16",
            total,
            self.nbytes / total / 1e9,
            ceiling,
            wrong,
            floor=self.floor,
            ceiling_kind=self.kind or "",
            device=self.device,
            changed=self.changed,
            bucket_bytes=self.bucket_bytes,
            steps=laps,
            parts=_critical_parts(laps, at_prepare, ranks),
            sender=sender,
            times_s=[s[0] for s in self._samples],
            ceiling_times_s=self._ceiling_times,
        )


def gate_failures(rows: list[SyncRow]) -> list[str]:
    """The rows that fail the throughput gate, one line each (for a report's verdict)."""
    return [f"{r.path} {r.receivers}rx {r.size_bytes}: {r.verdict}" for r in rows if not r.passed]


class Floors(dict):
    """Floors by path: the defaults with what the user set (`explicit`: the paths named on the command
    line). A GPU row takes the GPU tiers unless its path was named, never the CPU default."""

    explicit: frozenset[str] = frozenset()


def _explicit(floors: dict[str, float] | None) -> frozenset[str]:
    if floors is None or floors is CPU_FLOORS:
        return frozenset()
    return floors.explicit if isinstance(floors, Floors) else frozenset(floors)


def parse_floors(specs: list[str], defaults: dict[str, float]) -> Floors:
    """`["ipc=0.7", ...]` over the defaults; a malformed one is a usage error naming it."""
    floors = Floors(defaults)
    floors.explicit = frozenset(spec.partition("=")[0].strip() for spec in specs)
    for spec in specs:
        path, sep, value = spec.partition("=")
        try:
            ratio = float(value)
        except ValueError:
            ratio = -1.0
        if not sep or not path or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"floor {spec!r}: expected PATH=RATIO with RATIO between 0 and 1, e.g. ipc=0.7")
        floors[path.strip()] = ratio
    return floors


def floor_for(
    path: str, size_bytes: int, floors: dict[str, float] | None = None, ceiling: str | None = None
) -> float:
    """The gate of a row: the path's floor at GATED_FROM_BYTES and above; smaller rows are reported only
    (a fixed cost per sync dominates them). Against a GPU ceiling (GPU_CEILINGS) the floor is the tier of
    GPU_FLOOR_TIERS the size reaches, unless `floors` names the path (`--floor PATH=RATIO`)."""
    if size_bytes < GATED_FROM_BYTES:
        return 0.0
    if ceiling in GPU_CEILINGS and path not in _explicit(floors):
        return next((floor for at, floor in GPU_FLOOR_TIERS if size_bytes >= at), 0.0)
    floors = CPU_FLOORS if floors is None else floors
    return floors.get(path, 0.0)


def measure_sync(
    backend: Backend,
    sizes: list[int],
    receivers: int,
    repeats: int = 5,
    workdir: str | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    floors: dict[str, float] | None = None,
    fraction: float | None = None,
    engine: str | None = None,
    bucket_bytes: int | None = None,
    n_tensors: int = 8,
) -> list[SyncRow]:
    """One row per size (SyncBench): the median of `repeats` full pushes, each preceded by two ceiling
    repeats; the ceiling is the best of its repeats. `engine`: the import path of the receivers' engine
    factory, None for the backend's default (it must take any bf16 spec: Capabilities.arbitrary_tensors).
    `bucket_bytes`, `n_tensors`: as SyncBench takes them; a row of the bucket sweep is measured, not gated."""
    rows = []
    swept = fraction not in (None, DEFAULT_CHANGED) or bucket_bytes is not None
    unit = f", {bucket_bytes / 2**20:g} MiB buckets" if bucket_bytes else ""
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        for size in sizes:
            # gated in the RL regime at the backend's own unit; the rest of a sweep is measured, not gated
            floor = 0.0 if swept else floor_for(backend.name, size, floors, ceiling_kind(backend))
            with SyncBench(
                backend,
                size,
                receivers,
                workdir or tmp,
                floor,
                fraction,
                repeats,
                engine,
                bucket_bytes=bucket_bytes,
                n_tensors=n_tensors,
            ) as bench:
                for i in range(repeats):
                    progress(
                        f"{backend.name}: {receivers} receiver(s), {bench.nbytes / 2**20:.0f} MiB{unit}, "
                        f"repeat {i + 1}/{repeats}"
                    )
                    args, _ = bench.before()
                    bench.push(*args)
                rows.append(bench.row())
    return rows
