"""Sync throughput, measured beside the ceiling of the same transport on the same machine.

One row per (path, receivers, size), nccl-tests style: time is the median full lifecycle (start,
deliver, finish on every engine), algbw = bytes / time, and #wrong counts tensors that did not arrive
bit for bit (checked in the same run). The ceiling is the raw transport without the harness: file
write + fsync, then mapped by every receiver, for disk; a bare gloo broadcast of the path's own messages (its bucket plan) to
receiver processes for broadcast, warm copies for ipc.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch

from harness import phases
from harness.api import Backend, spec_of
from harness.ceilings import ceiling_kind, make_ceiling
from harness.checks import bitwise_mismatches
from harness.deployment import push
from harness.devices import normalize, run_device

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
    backend: str = ""  # the backend as it was named (a factory path); `path` is its display name
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
#: harness/report/markdown_page.py, report.html in harness/report/html_page.py); throughput_cells gives a row's text in this order.
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
