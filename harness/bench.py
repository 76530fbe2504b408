"""Sync throughput, measured beside the ceiling of the same transport on the same machine.

One row per (path, receivers, size), nccl-tests style: time is the median full lifecycle (start,
deliver, finish on every engine), algbw = bytes / time, and #wrong counts tensors that did not arrive
bit for bit (checked in the same run). The ceiling is the raw transport without the harness: file
write + fsync + read for disk, a bare gloo broadcast of the same buckets for broadcast.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime
import gc
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from harness import phases
from harness.api import Backend
from harness.checks import bitwise_mismatches
from harness.deployment import push
from harness.manifest import DEFAULT_BUCKET_BYTES
from fixtures.payloads import spec_of


#: Default floors of the throughput gate (ratio to the ceiling), per path on CPU. A row below its floor,
#: or with #wrong > 0, fails certification; `weightsync certify --floor PATH=RATIO` overrides one.
CPU_FLOORS = {"disk": 0.8, "broadcast": 0.8, "delta": 0.8, "ipc": 0.7, "delta-ipc": 0.7}
#: Parts of a row's critical path, in the order of its stacked bar: the trainer's prepare (digest,
#: alloc, pack), the slowest receiver's transfer (wire, unpack, verify), its commit, and the rest
#: (control: RPC, locks, Python between the steps).
BAR_PARTS = ("digest", "alloc", "pack", "wire", "unpack", "verify", "commit", "control")


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
    steps: dict[str, float] = dataclasses.field(default_factory=dict)  # start, prepare, transfer, finish
    parts: dict[str, float] = dataclasses.field(default_factory=dict)  # BAR_PARTS of the median repeat
    sender: dict[str, float] = dataclasses.field(default_factory=dict)  # every sender phase (overlaps included)
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
        return self.verdict in ("ok", "no ceiling") if not self.floor else self.verdict == "ok"

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": round(self.ratio, 4), "verdict": self.verdict}


def payload(size_bytes: int, n_tensors: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded bf16 tensors totalling about `size_bytes`."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, size_bytes // 2 // n_tensors)
    return {f"bench.{i}.weight": torch.randn(per, generator=gen).to(torch.bfloat16) for i in range(n_tensors)}


# ---------------------------------------------------------------------------- ceilings
class Ceiling:
    """The raw transport under a path, set up once and timed one repeat at a time, so its repeats can
    be interleaved with the path's own (a ceiling taken at another moment measures another machine)."""

    def once(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


class DiskCeiling(Ceiling):
    """One file written with fsync, then read back by every receiver at once: 1 write, N reads."""

    def __init__(self, size_bytes: int, directory: str, receivers: int = 1):
        self.data = os.urandom(min(size_bytes, 1 << 20)) * max(1, size_bytes // (1 << 20))
        self.path = Path(directory) / "ceiling.bin"
        self.receivers = receivers

    def _read(self, _: int) -> None:
        with open(self.path, "rb") as f:
            f.read()

    def once(self) -> float:
        t0 = time.perf_counter()
        with open(self.path, "wb") as f:
            f.write(self.data)
            f.flush()
            os.fsync(f.fileno())
        if self.receivers == 1:
            self._read(0)
        else:
            with cf.ThreadPoolExecutor(self.receivers) as pool:
                list(pool.map(self._read, range(self.receivers)))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class GlooCeiling(Ceiling):
    """A bare gloo broadcast of the same buckets among 1 + receivers ranks (threads, groups kept)."""

    def __init__(self, size_bytes: int, receivers: int, bucket_bytes: int):
        world = receivers + 1
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        n_buckets = max(1, -(-size_bytes // bucket_bytes))
        sizes = [min(bucket_bytes, size_bytes - i * bucket_bytes) for i in range(n_buckets)]
        self.go = threading.Barrier(world + 1)
        self.done = threading.Barrier(world + 1)
        self.stop = False
        self.error: BaseException | None = None

        def rank(r: int) -> None:
            try:
                s = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, world, is_master=False, timeout=timeout)
                group = dist.ProcessGroupGloo(dist.PrefixStore("ceiling/", s), r, world, timeout)
                bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
            except BaseException as exc:  # noqa: BLE001 - reported by once()
                self.error = exc
                self.go.abort()
                return
            while True:
                self.go.wait()
                if self.stop:
                    return
                for b in bufs:
                    group.broadcast(b, 0).wait()
                self.done.wait()

        self.threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
        for t in self.threads:
            t.start()
        self._store = store

    def once(self) -> float:
        try:
            self.go.wait(timeout=60)
            t0 = time.perf_counter()
            self.done.wait(timeout=60)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"gloo ceiling failed: {self.error}") from self.error
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stop = True
        try:
            self.go.wait(timeout=10)
        except threading.BrokenBarrierError:
            pass
        for t in self.threads:
            t.join(10)


class MemcpyCeiling(Ceiling):
    """One warm copy of the payload's bytes in this process (what mapping shared memory saves)."""

    def __init__(self, size_bytes: int):
        self.src = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def once(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


def make_ceiling(backend: Backend, nbytes: int, receivers: int, workdir: str) -> Ceiling | None:
    """The raw transport under the path: file write+read, bare gloo broadcast, or memcpy."""
    name = backend.name
    if name == "disk":
        return DiskCeiling(nbytes, workdir, receivers)
    if name in ("broadcast", "delta"):
        return GlooCeiling(nbytes, receivers, getattr(backend, "bucket_bytes", DEFAULT_BUCKET_BYTES))
    if name in ("ipc", "delta-ipc"):
        return MemcpyCeiling(nbytes)
    return None


def best_of(ceiling: Ceiling, repeats: int) -> float:
    """Seconds of the fastest of `repeats` runs after a warm-up (for a ceiling measured on its own)."""
    ceiling.once()
    return min(ceiling.once() for _ in range(max(repeats, 1)))


def disk_ceiling(size_bytes: int, directory: str, repeats: int = 3) -> float:
    c = DiskCeiling(size_bytes, directory)
    try:
        return len(c.data) / best_of(c, max(repeats, 5)) / 1e9
    finally:
        c.close()


def gloo_broadcast_ceiling(size_bytes: int, receivers: int, bucket_bytes: int, repeats: int = 3) -> float:
    c = GlooCeiling(size_bytes, receivers, bucket_bytes)
    try:
        return size_bytes / best_of(c, max(repeats, 5)) / 1e9
    finally:
        c.close()


def memcpy_ceiling(size_bytes: int, repeats: int = 3) -> float:
    return size_bytes / best_of(MemcpyCeiling(size_bytes), max(repeats, 5)) / 1e9


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


def _critical_parts(steps: dict[str, float], sender: dict[str, float], receivers: list[dict[str, float]]) -> dict:
    """The stacked bar of one push: what the trainer did while preparing, what the slowest receiver did
    while the bytes moved, its commit, and the rest as control (see BAR_PARTS)."""
    slowest = max(receivers, key=lambda r: sum(r.values()), default={})
    parts = {p: sender.get(p, 0.0) for p in ("digest", "alloc", "pack")}
    parts.update({p: slowest.get(p, 0.0) for p in ("wire", "unpack", "verify", "commit")})
    parts["control"] = max(0.0, sum(steps.values()) - sum(parts.values()))
    return parts


def measure_sync(
    backend: Backend,
    sizes: list[int],
    receivers: int,
    repeats: int = 5,
    workdir: str | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    floors: dict[str, float] | None = None,
    fraction: float | None = None,
) -> list[SyncRow]:
    """One row per size: the median full push (start, prepare, transfer, finish on every engine) over
    `repeats`, each followed by one repeat of the ceiling; the ceiling is the best of its repeats.
    Delta paths push a new version with `fraction` (default 1%) of entries changed each time (the RL
    regime) and count the dense bytes delivered (effective bandwidth)."""
    floors = CPU_FLOORS if floors is None else floors
    rows = []
    was_recording = phases.enabled()
    phases.set_enabled(True)  # before deploy: spawned ranks record too
    try:
        with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
            wd = workdir or tmp
            for size in sizes:
                rows.append(_measure_one(backend, size, receivers, repeats, wd, progress,
                                         floors.get(backend.name, 0.0), fraction))
    finally:
        phases.set_enabled(was_recording)
    return rows


def _measure_one(backend, size, receivers, repeats, wd, progress, floor, fraction) -> SyncRow:
    weights = payload(size)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    changed = (0.01 if fraction is None else fraction) if backend.capabilities.delta else 0.0
    steps = _versions(weights, changed, repeats + 1)
    samples = []  # (total, steps, sender phases, receiver phases)
    ceiling_times = []
    with backend.deploy(receivers, spec_of(weights), str(Path(wd) / f"{backend.name}-{size}")) as dep:
        take_ranks = getattr(dep, "take_phases", lambda: [])
        ceiling = make_ceiling(backend, nbytes, receivers, wd)
        try:
            version = iter(range(1, 1000))
            push(dep, next(version), weights)  # warm-up: connections, page cache, allocator
            if ceiling is not None:
                ceiling.once()
            last = weights
            for i in range(repeats):
                progress(f"{backend.name}: {receivers} receiver(s), {nbytes / 2**20:.0f} MiB, repeat {i + 1}/{repeats}")
                last = next(steps)
                phases.take()
                take_ranks()
                laps: dict[str, float] = {}
                prepared: dict[str, dict[str, float]] = {}
                gc.collect()
                gc.disable()  # a collection inside one repeat is the harness's noise, not the path's
                try:
                    push(dep, next(version), last, timings=laps,
                         on_lap=lambda name: prepared.update(phases.take()) if name == "prepare" else None)
                finally:
                    gc.enable()
                rest = phases.take()
                sender = {k: prepared.get("sender", {}).get(k, 0.0) + rest.get("sender", {}).get(k, 0.0)
                          for k in set(prepared.get("sender", {})) | set(rest.get("sender", {}))}
                in_process = rest.get("receiver", {})  # receivers that live in this process
                ranks = [r.get("receiver", {}) for r in take_ranks()] or ([in_process] if in_process else [])
                samples.append((sum(laps.values()), laps, prepared.get("sender", {}), sender, ranks))
                if ceiling is not None:
                    ceiling_times.append(ceiling.once())
            wrong = sum(len(bitwise_mismatches(last, h.engine.read_weights())) for h in dep.handles)
        finally:
            if ceiling is not None:
                ceiling.close()
    samples.sort(key=lambda s: s[0])
    total, laps, at_prepare, sender, ranks = samples[len(samples) // 2]
    ceiling_gbs = nbytes / min(ceiling_times) / 1e9 if ceiling_times else 0.0
    return SyncRow(backend.name, receivers, nbytes, len(weights), "bf16", total, nbytes / total / 1e9, ceiling_gbs,
                   wrong, floor=floor, steps=laps, parts=_critical_parts(laps, at_prepare, ranks), sender=sender,
                   times_s=[s[0] for s in samples], ceiling_times_s=ceiling_times)
