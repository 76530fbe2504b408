"""Sync throughput, measured beside the ceiling of the same transport on the same machine.

One row per (path, receivers, size), nccl-tests style: time is the median full lifecycle (start,
deliver, finish on every engine), algbw = bytes / time, and #wrong counts tensors that did not arrive
bit for bit (checked in the same run). The ceiling is the raw transport without the harness: file
write + fsync + read for disk, a bare gloo broadcast of the same buckets for broadcast.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from harness.api import Backend
from harness.checks import bitwise_mismatches
from harness.deployment import push
from harness.manifest import DEFAULT_BUCKET_BYTES
from fixtures.payloads import spec_of


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

    @property
    def ratio(self) -> float:
        return self.algbw_gbs / self.ceiling_gbs if self.ceiling_gbs else 0.0

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": round(self.ratio, 4)}


def payload(size_bytes: int, n_tensors: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded bf16 tensors totalling about `size_bytes`."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, size_bytes // 2 // n_tensors)
    return {f"bench.{i}.weight": torch.randn(per, generator=gen).to(torch.bfloat16) for i in range(n_tensors)}


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _best_time(fn: Callable[[], None], repeats: int) -> float:
    """A ceiling is what the hardware can do: the fastest of several runs after a warm-up (first-touch
    page faults and a stray scheduler hiccup on a small box are not the transport's limit)."""
    fn()
    times = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def disk_ceiling(size_bytes: int, directory: str, repeats: int = 3) -> float:
    """GB/s of writing one file with fsync and reading it back: what any disk path is bounded by."""
    data = os.urandom(min(size_bytes, 1 << 20)) * max(1, size_bytes // (1 << 20))
    path = Path(directory) / "ceiling.bin"

    def once() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            f.read()

    t = _best_time(once, repeats)
    path.unlink(missing_ok=True)
    return len(data) / t / 1e9


def gloo_broadcast_ceiling(size_bytes: int, receivers: int, bucket_bytes: int, repeats: int = 3) -> float:
    """GB/s of a bare gloo broadcast of the same buckets among 1 + receivers ranks (threads here)."""
    world = receivers + 1
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    n_buckets = max(1, -(-size_bytes // bucket_bytes))
    sizes = [min(bucket_bytes, size_bytes - i * bucket_bytes) for i in range(n_buckets)]
    times: list[float] = []
    barrier = threading.Barrier(world)

    def rank(r: int) -> None:
        s = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, world, is_master=False, timeout=timeout)
        group = dist.ProcessGroupGloo(dist.PrefixStore("ceiling/", s), r, world, timeout)
        bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        for i in range(max(repeats, 5) + 1):  # the first is the warm-up
            barrier.wait()
            t0 = time.perf_counter()
            for b in bufs:
                group.broadcast(b, 0).wait()
            barrier.wait()
            if r == 0 and i > 0:
                times.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return size_bytes / min(times) / 1e9


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


def memcpy_ceiling(size_bytes: int, repeats: int = 3) -> float:
    src = torch.randint(0, 255, (size_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return size_bytes / _best_time(lambda: dst.copy_(src), repeats) / 1e9


def ceiling_of(backend: Backend, nbytes: int, receivers: int, workdir: str, repeats: int) -> float:
    """The raw transport under the path: file write+read, bare gloo broadcast, or memcpy."""
    name = backend.name
    if name == "disk":
        return disk_ceiling(nbytes, workdir, repeats)
    if name in ("broadcast", "delta"):
        return gloo_broadcast_ceiling(nbytes, receivers, getattr(backend, "bucket_bytes", DEFAULT_BUCKET_BYTES), repeats)
    if name in ("ipc", "delta-ipc"):
        return memcpy_ceiling(nbytes, repeats)
    return 0.0


def measure_sync(
    backend: Backend,
    sizes: list[int],
    receivers: int,
    repeats: int = 3,
    workdir: str | None = None,
    progress: Callable[[str], None] = lambda msg: None,
) -> list[SyncRow]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        wd = workdir or tmp
        for size in sizes:
            weights = payload(size)
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            progress(f"{backend.name}: {receivers} receiver(s), {nbytes / 2**20:.0f} MiB")
            # delta paths get a new version with 1% of entries changed each push (the RL regime);
            # their algbw counts the dense bytes delivered, i.e. effective bandwidth
            steps = _versions(weights, 0.01 if backend.capabilities.delta else 0.0, repeats + 1)
            with backend.deploy(receivers, spec_of(weights), str(Path(wd) / f"{backend.name}-{size}")) as dep:
                version = iter(range(1, 1000))
                push(dep, next(version), weights)  # warm-up: connections, page cache, allocator
                last = weights

                def one_push() -> None:
                    nonlocal last
                    last = next(steps)
                    push(dep, next(version), last)

                t = _median_time(one_push, repeats)
                wrong = sum(len(bitwise_mismatches(last, h.engine.read_weights())) for h in dep.handles)
            ceiling = ceiling_of(backend, nbytes, receivers, wd, repeats)
            rows.append(SyncRow(backend.name, receivers, nbytes, len(weights), "bf16", t, nbytes / t / 1e9, ceiling, wrong))
    return rows
