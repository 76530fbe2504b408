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
from harness.checks import digest_mismatches
from harness.deployment import push
from harness.devices import normalize, run_device
from harness.host_load import OtherLoad

#: The throughput gate (harness.throughput_model) by ceiling kind, for a backend that declares none of its
#: own (`Backend.bandwidth_floor`, `Backend.fixed_cost_ms`): the fraction of the verified ceiling's
#: bandwidth a path must reach, and what one sync may cost beyond its bytes (ms: the round trips to the
#: ranks, the lifecycle calls). A row passes when its time is within `fixed + verified time / fraction`.
#: GPU kinds: a verified sync can reach the verified ceiling (on the H200 same-GPU ipc moved its bytes at
#: 1.00 of it, 2026-12-04), 0.85 leaves the noise. Host kinds: the 2-core CI VM, shared with other jobs
#: (docs/performance.md, "The model"); a loaded host slows the fixed cost first.
DEFAULT_FLOORS: dict[str, tuple[float, float]] = {
    "device-copy": (0.85, 10.0),
    "p2p-copy": (0.85, 10.0),
    "h2d-copy": (0.85, 20.0),
    "nccl": (0.85, 20.0),
    "memcpy": (0.25, 60.0),
    "gloo": (0.4, 80.0),  # broadcast: 0.65 (a path half as fast, 0.33, fails)
    "disk": (0.2, 150.0),
}
_GPU_REASON = (
    "a verified sync can reach the verified ceiling (same-GPU ipc moved its bytes at 1.00 of it on the "
    "H200, 2026-12-04); 0.85 leaves room for noise"
)
#: Why each default of DEFAULT_FLOORS is what it is: the report prints it beside the floor.
DEFAULT_FLOOR_REASONS: dict[str, str] = {
    "device-copy": _GPU_REASON,
    "p2p-copy": _GPU_REASON,
    "h2d-copy": _GPU_REASON,
    "nccl": _GPU_REASON,
    "memcpy": "a host copy on a loaded 2-core CI VM: catches a path that hangs, loses bytes or gets several "
    "times slower (docs/performance.md, 'Floors on CPU'); a loaded host slows the fixed cost first",
    "gloo": "broadcast measured 0.65 of its verified ceiling on the 2-core CI VM (2026-12-04): a path half "
    "as fast (0.33) fails; a loaded host slows the fixed cost first",
    "disk": "disk measured 0.69 of its verified ceiling on the 2-core CI VM (2026-12-04); 0.2 leaves room "
    "for a loaded VM's fsync stalls, which slow the fixed cost first",
}
GPU_CEILINGS = ("device-copy", "p2p-copy", "h2d-copy", "nccl")
CEILING_REPEATS_PER_PUSH = 2
#: A gated row that misses its floors is measured again, up to this many rounds of its repeats, and keeps
#: its best round: a path that is slow is slow in every round; a host that was busy for one is not the
#: path's fault (the row lists every round's median, so a reader sees what was taken).
ROW_ROUNDS = 3
#: Other jobs using this many CPUs or more (on average, while a row was measured) make the host busy: a row
#: that misses its floors then is not judged (COULD NOT DECIDE, naming the load), never FAIL.
BUSY_CORES = 0.5
BARE_PAYLOAD_BYTES = 16  # the bare lifecycle row: one bf16 element in each of the 8 tensors
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
    floor: float = 0.0  # the bandwidth floor: a fraction of the verified ceiling's bandwidth (0: not gated)
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
    verified_times_s: list[float] = dataclasses.field(default_factory=list)  # the verified ceiling's repeats
    fixed_allowed_s: float = 0.0  # what one sync may cost beyond its bytes (the gate's second floor)
    floor_source: str = ""  # declared, default (ceiling kind), --floor
    floor_reason: str = ""  # why the floors are what they are (Gate.reason)
    swept: bool = False  # a row of a bucket or changed-fraction sweep: measured, not gated, not fitted
    rounds_s: list[float] = dataclasses.field(default_factory=list)  # each round's median (ROW_ROUNDS)
    other_cores: float = 0.0  # CPUs' worth of other jobs' work on the host while the row was measured

    @property
    def ratio(self) -> float:
        """algbw over the raw transport's bandwidth (the copy, the bare broadcast): shown, not gated."""
        return self.algbw_gbs / self.ceiling_gbs if self.ceiling_gbs else 0.0

    @property
    def verified_gbs(self) -> float:
        """The verified ceiling's bandwidth at this size: the raw transport plus the harness's digests."""
        return self.size_bytes / min(self.verified_times_s) / 1e9 if self.verified_times_s else 0.0

    @property
    def allowed_s(self) -> float:
        """The most this row may take: the fixed cost allowed plus the verified ceiling's time over the
        bandwidth floor (0: not gated)."""
        if not self.floor or not self.verified_times_s:
            return 0.0
        return self.fixed_allowed_s + min(self.verified_times_s) / self.floor

    @property
    def host_busy(self) -> bool:
        """Other jobs took BUSY_CORES or more of the host's CPUs while this row was measured."""
        return self.other_cores >= BUSY_CORES

    @property
    def verdict(self) -> str:
        """ok; wrong (a tensor differed); unreliable (faster than its raw transport: the ceiling was not
        one); below floor (slower than the two floors allow at its size); host busy (that, on a host where
        other jobs took BUSY_CORES or more: not judged); or no ceiling."""
        if self.wrong:
            return "wrong"
        if not self.ceiling_gbs:
            return "no ceiling"
        if self.ratio > 1.0:
            return "unreliable"
        if self.allowed_s and self.time_s > self.allowed_s:
            return "host busy" if self.host_busy else "below floor"
        return "ok"

    @property
    def passed(self) -> bool:
        """The gate: nothing wrong, and within what its floors allow where the row is gated (an unreliable
        row is not a pass: its ceiling was no ceiling)."""
        return not self.wrong and (not self.floor or self.verdict == "ok")

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "ratio": round(self.ratio, 4),
            "verified_gbs": round(self.verified_gbs, 4),
            "allowed_s": round(self.allowed_s, 6),
            "verdict": self.verdict,
        }


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
    "verified (GB/s)",
    "allowed (ms)",
    "#wrong",
    "verdict",
)


def throughput_cells(row: SyncRow) -> list[str]:
    """The cells of one throughput row as every renderer shows them (they only style them), one per
    THROUGHPUT_COLUMNS. The verdict cell is SyncRow.verdict (wrong, no ceiling, unreliable, below floor,
    ok), gated or not: a row that is not gated shows `–` as its allowed time, and `passed` is what gates;
    a row measured again after missing its floor says which round it reports ("ok (round 2 of 3)")."""
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
        f"{row.verified_gbs:.3f}" if row.verified_times_s else "–",
        f"{row.allowed_s * 1e3:.2f}" if row.allowed_s else "–",
        str(row.wrong),
        row.verdict
        + (f" (round {_round_taken(row)} of {len(row.rounds_s)})" if len(row.rounds_s) > 1 else ""),
    ]


def _round_taken(row: SyncRow) -> int:
    """Which of a re-measured row's rounds it reports (1-based): the first that passed, else the fastest."""
    return row.rounds_s.index(row.time_s) + 1 if row.time_s in row.rounds_s else len(row.rounds_s)


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
        gate: Gate | None = None,
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
        self.backend, self.receivers, self.gate, self.engine = backend, receivers, gate, engine
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
        self._versions = _versions(self.weights, self.changed, repeats * ROW_ROUNDS + 1)
        bucket = f"-b{bucket_bytes}" if bucket_bytes else ""  # rows of a sweep do not share a directory
        self._workdir = str(Path(workdir) / f"{backend.name}-{size}-{receivers}{bucket}")
        self._samples: list[tuple] = []  # (total, laps, sender at prepare, sender, receivers)
        self._ceiling_times: list[float] = []
        self._verified_times: list[float] = []
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
            self._others = OtherLoad()  # what other jobs ran while this row's repeats were measured
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
            for _ in range(CEILING_REPEATS_PER_PUSH):
                raw, verified = self.ceiling.verified_once()
                self._ceiling_times.append(raw)
                self._verified_times.append(verified)
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

    def next_round(self) -> None:
        """The pushes measured so far are set aside: the next row() is of the pushes that follow (the
        ceiling keeps every repeat: it is the best of them)."""
        self._samples = []
        self._others = OtherLoad()

    def row(self) -> SyncRow:
        """The median push, its breakdown, the best ceiling repeat, and #wrong read back from every engine."""
        # digested where each engine lives: a 16 GiB read-back copied through a pipe took most of a row
        wrong = sum(len(digest_mismatches(self.last, h.engine)) for h in self.deployment.handles)
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
            floor=self.gate.bandwidth_floor if self.gate else 0.0,
            fixed_allowed_s=self.gate.fixed_allowed_s if self.gate else 0.0,
            floor_source=self.gate.source if self.gate else "",
            floor_reason=self.gate.reason if self.gate else "",
            ceiling_kind=self.kind or "",
            device=self.device,
            changed=self.changed,
            bucket_bytes=self.bucket_bytes,
            steps=laps,
            parts=_critical_parts(laps, at_prepare, ranks),
            sender=sender,
            times_s=[s[0] for s in self._samples],
            ceiling_times_s=self._ceiling_times,
            verified_times_s=self._verified_times,
            other_cores=round(self._others.cores(), 3),
        )


def measure_row(bench: SyncBench, repeats: int, progress: Callable[[str], None], label: str) -> SyncRow:
    """One row in up to ROW_ROUNDS rounds of `repeats` pushes: a round that passes, or reads a wrong byte,
    ends it; the row is the pass, else the fastest miss on a quiet host (the path's own), else the fastest
    busy round. `label` names the row in the progress lines."""
    tried = []
    for attempt in range(ROW_ROUNDS):
        again = f", again ({attempt + 1} of {ROW_ROUNDS}: the last missed its floor)" if attempt else ""
        for i in range(repeats):
            progress(f"{label}, repeat {i + 1}/{repeats}{again}")
            args, _ = bench.before()
            bench.push(*args)
        tried.append(bench.row())
        if tried[-1].passed or tried[-1].wrong:
            break
        bench.next_round()
    quiet = [r for r in tried if not r.host_busy]
    row = next((r for r in tried if r.passed), min(quiet or tried, key=lambda r: r.time_s))
    row.rounds_s = [r.time_s for r in tried]
    return row


def gate_failures(rows: list[SyncRow]) -> list[str]:
    """The rows that fail the throughput gate, and the paths whose fitted line fails it, one line each
    (for a report's verdict)."""
    from harness.throughput_model import fit_paths

    out = [f"{r.path} {r.receivers}rx {r.size_bytes}: {r.verdict}" for r in rows if judged_failed(r)]
    busy = {(r.path, r.receivers) for r in rows if r.host_busy}
    for fit in fit_paths(rows):
        if (fit.path, fit.receivers) not in busy:
            out += [f"{fit.path} {fit.receivers}rx fitted: {why}" for why in fit.failures()]
    return out


def judged_failed(row: SyncRow) -> bool:
    """A row that fails the gate; a miss on a busy host ("host busy") is not judged (harness.report's
    verdict makes it COULD NOT DECIDE)."""
    return not row.passed and row.verdict != "host busy"


def busy_rows(rows: list[SyncRow]) -> list[str]:
    """The rows, and fitted paths, left unjudged because other jobs took the host's CPUs, one line each."""
    from harness.throughput_model import fit_paths

    out = [
        f"throughput {r.path} {r.receivers}rx {r.size_bytes} B: not judged, other jobs used "
        f"{r.other_cores:.1f} CPUs while it was measured ({r.time_s * 1e3:.2f} ms where "
        f"{r.allowed_s * 1e3:.2f} ms is allowed); measure it again on a quiet host"
        for r in rows
        if r.verdict == "host busy"
    ]
    busy = {(r.path, r.receivers) for r in rows if r.host_busy}
    for fit in fit_paths(rows):
        if (fit.path, fit.receivers) in busy and fit.failures():
            out.append(
                f"throughput {fit.path} {fit.receivers}rx fitted: not judged (rows measured on a busy host): "
                + "; ".join(fit.failures())
            )
    return out


class Floors(dict):
    """Bandwidth floors named on the command line (`--floor PATH=RATIO`), by path name: they replace what
    the path declares or its ceiling kind's default."""


def parse_floors(specs: list[str]) -> Floors:
    """`["ipc=0.7", ...]`; a malformed one is a usage error naming it (harness.cli_args.parse_floor)."""
    from harness.cli_args import parse_floor

    return Floors(parse_floor(spec) for spec in specs)


@dataclasses.dataclass(frozen=True)
class Gate:
    """A path's two floors (harness.throughput_model), where the bandwidth floor came from, and why they
    are what they are (the backend's `floor_reason`, DEFAULT_FLOOR_REASONS, or the command line)."""

    bandwidth_floor: float
    fixed_allowed_s: float
    source: str
    reason: str = ""


def gate_for(backend: Backend, floors: dict[str, float] | None = None) -> Gate | None:
    """The gate a backend's rows are judged by: `--floor PATH=RATIO` first, then what the backend declares
    (`bandwidth_floor`, `fixed_cost_ms`), then its ceiling kind's default (DEFAULT_FLOORS) — never a floor
    of zero. None where it declares no ceiling (its rows say "no ceiling")."""
    kind = ceiling_kind(backend)
    if kind is None:
        return None
    default_bw, default_ms = DEFAULT_FLOORS[kind]
    declared_bw = getattr(backend, "bandwidth_floor", None)
    declared_ms = getattr(backend, "fixed_cost_ms", None)
    declared_why = getattr(backend, "floor_reason", None) or "declared by the backend, no reason given"
    if floors and backend.name in floors:
        bw, source, why = (
            floors[backend.name],
            "--floor",
            f"named on the command line (--floor {backend.name}=...)",
        )
    elif declared_bw is not None:
        bw, source, why = float(declared_bw), "declared", declared_why
    else:
        bw, source, why = default_bw, f"default of {kind}", DEFAULT_FLOOR_REASONS[kind]
    ms = float(declared_ms) if declared_ms is not None else default_ms
    if declared_ms is None:
        source += f"; fixed: default of {kind}"
        if not source.startswith("default"):
            why += f"; fixed cost, default of {kind}: {DEFAULT_FLOOR_REASONS[kind]}"
    elif not source.startswith("declared"):
        why += f"; fixed cost, declared: {declared_why}"
    return Gate(bw, ms / 1e3, source, why)


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
    bare: bool = False,
) -> list[SyncRow]:
    """One row per size (SyncBench): the median of `repeats` full pushes, each preceded by two ceiling
    repeats; the ceiling is the best of its repeats. `engine`: the import path of the receivers' engine
    factory, None for the backend's default (it must take any bf16 spec: Capabilities.arbitrary_tensors).
    `bucket_bytes`, `n_tensors`: as SyncBench takes them; a row of the bucket sweep is measured, not gated.
    `bare`: first a row of the bare lifecycle (one element per tensor: the round trips with an empty
    payload), which the fit (harness.throughput_model) starts from."""
    rows = []
    sizes = ([BARE_PAYLOAD_BYTES] if bare else []) + list(sizes)
    swept = fraction not in (None, DEFAULT_CHANGED) or bucket_bytes is not None
    unit = f", {bucket_bytes / 2**20:g} MiB buckets" if bucket_bytes else ""
    with tempfile.TemporaryDirectory(prefix="weightsync-bench-") as tmp:
        for size in sizes:
            # gated in the RL regime at the backend's own unit; the rest of a sweep is measured, not gated
            with SyncBench(
                backend,
                size,
                receivers,
                workdir or tmp,
                None if swept else gate_for(backend, floors),
                fraction,
                repeats,
                engine,
                bucket_bytes=bucket_bytes,
                n_tensors=n_tensors,
            ) as bench:
                what = f"{bench.nbytes / 2**20:.0f} MiB" if size > BARE_PAYLOAD_BYTES else "bare lifecycle"
                row = measure_row(
                    bench, repeats, progress, f"{backend.name}: {receivers} receiver(s), {what}{unit}"
                )
                row.swept = swept
                rows.append(row)
    return rows
