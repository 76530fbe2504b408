"""The throughput gate's model: a push costs `time = fixed + bytes / bandwidth`.

A ratio per row mixes the two terms: at 64 MiB on a GPU a 5 ms round trip is most of the time, so a path
that moves bytes at the limit of the hardware read 0.01 of a device copy and failed a floor no sync can
meet. The model separates them. Fitted over the sizes of a run (from where the fixed cost dominates to
where the bytes do), each term is judged against its own bound:

- the **bandwidth** against the *verified ceiling*: the same bytes digested on the trainer side and
  copied-and-digested on the receiver side by the harness's own kernels, over the raw transport the
  backend declares (harness.ceilings), fitted over the same sizes;
- the **fixed cost** against what the backend declares it may cost per sync (ms), shown beside the
  bare lifecycle measured in the run (the same round trips with an empty payload).

A row passes when its time is within what the two allow at its size:
`time <= fixed_allowed + verified_ceiling_time / bandwidth_floor`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

#: Sizes below this count as the bare lifecycle (an empty payload: a few bytes per tensor).
BARE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Line:
    """time = fixed_s + bytes / (bandwidth_gbs * 1e9), least squares over (bytes, seconds) points."""

    fixed_s: float
    bandwidth_gbs: float
    points: int

    def time_at(self, nbytes: int) -> float:
        return self.fixed_s + (nbytes / (self.bandwidth_gbs * 1e9) if self.bandwidth_gbs else 0.0)


def fit_line(points: Iterable[tuple[int, float]]) -> Line | None:
    """The least-squares line through (bytes, seconds); None with fewer than two distinct sizes. A negative
    intercept (noise at the small sizes) is clamped to 0 and the slope refitted through the origin; a
    non-positive slope (time that does not grow with bytes) has no bandwidth: None."""
    pts = [(float(b), float(t)) for b, t in points]
    if len({b for b, _ in pts}) < 2:
        return None
    n = len(pts)
    mean_b = sum(b for b, _ in pts) / n
    mean_t = sum(t for _, t in pts) / n
    sxx = sum((b - mean_b) ** 2 for b, _ in pts)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in pts) / sxx
    fixed = mean_t - slope * mean_b
    if fixed < 0:
        fixed = 0.0
        slope = sum(b * t for b, t in pts) / sum(b * b for b, _ in pts)
    if slope <= 0:
        return None
    return Line(fixed, 1.0 / slope / 1e9, n)


@dataclasses.dataclass
class PathFit:
    """One path at one receiver count: its fitted line, its verified ceiling's, and the two floors."""

    path: str
    receivers: int
    device: str
    line: Line | None
    ceiling: Line | None  # the verified ceiling's fit over the same sizes
    bandwidth_floor: float  # ratio of the verified ceiling's bandwidth the path must reach
    fixed_allowed_s: float  # what the backend declares one sync may cost beyond the bytes
    bare_s: float | None  # the bare lifecycle's median time (empty payload), when it was measured
    floor_source: str = "default"  # declared, default (of the ceiling kind), --floor
    sizes: tuple[int, ...] = ()

    @property
    def bandwidth_ratio(self) -> float:
        if self.line is None or self.ceiling is None or not self.ceiling.bandwidth_gbs:
            return 0.0
        return self.line.bandwidth_gbs / self.ceiling.bandwidth_gbs

    def failures(self) -> list[str]:
        """Why the fit fails the gate (empty: it passes); a path with too few sizes to fit is judged by its rows."""
        if self.line is None or self.ceiling is None:
            return []
        out = []
        if self.bandwidth_ratio < self.bandwidth_floor:
            out.append(
                f"fitted bandwidth {self.line.bandwidth_gbs:.3f} GB/s is {self.bandwidth_ratio:.3f} of the "
                f"verified ceiling's {self.ceiling.bandwidth_gbs:.3f} GB/s, under its floor "
                f"{self.bandwidth_floor:g} ({self.floor_source})"
            )
        if self.line.fixed_s > self.fixed_allowed_s:
            bare = f"; bare lifecycle {self.bare_s * 1e3:.2f} ms" if self.bare_s is not None else ""
            out.append(
                f"fitted fixed cost {self.line.fixed_s * 1e3:.2f} ms per sync is over the "
                f"{self.fixed_allowed_s * 1e3:g} ms it may cost{bare}"
            )
        return out

    @property
    def verdict(self) -> str:
        if self.line is None or self.ceiling is None:
            return "not fitted"
        return "ok" if not self.failures() else "below floor"

    def to_json(self) -> dict:
        return {
            **{k: v for k, v in dataclasses.asdict(self).items() if k not in ("line", "ceiling")},
            "fixed_ms": None if self.line is None else round(self.line.fixed_s * 1e3, 4),
            "bandwidth_gbs": None if self.line is None else round(self.line.bandwidth_gbs, 4),
            "ceiling_fixed_ms": None if self.ceiling is None else round(self.ceiling.fixed_s * 1e3, 4),
            "ceiling_bandwidth_gbs": None if self.ceiling is None else round(self.ceiling.bandwidth_gbs, 4),
            "bandwidth_ratio": round(self.bandwidth_ratio, 4),
            "verdict": self.verdict,
            "failures": self.failures(),
        }


def fit_paths(rows: Sequence) -> list[PathFit]:
    """One PathFit per (path, receivers, device) over its gated rows (rows of a bucket or changed-fraction
    sweep are measured, not gated, and not fitted). Needs SyncRow's fields: time_s, size_bytes,
    verified_times_s, bandwidth_floor, fixed_allowed_s."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if r.swept:
            continue
        groups.setdefault((r.backend or r.path, r.receivers, r.device), []).append(r)
    fits = []
    for (_, receivers, device), group in groups.items():
        group = sorted(group, key=lambda r: r.size_bytes)
        bare = [r.time_s for r in group if r.size_bytes <= BARE_BYTES]
        verified = [(r.size_bytes, min(r.verified_times_s)) for r in group if r.verified_times_s]
        fits.append(
            PathFit(
                group[0].path,
                receivers,
                device,
                fit_line((r.size_bytes, r.time_s) for r in group) if len(group) >= 3 else None,
                fit_line(verified) if len(verified) >= 3 else None,
                group[-1].floor,
                group[-1].fixed_allowed_s,
                bare[0] if bare else None,
                group[-1].floor_source,
                tuple(r.size_bytes for r in group),
            )
        )
    return fits


#: The fitted table's columns, as every renderer heads them.
FIT_COLUMNS = (
    "path",
    "rx",
    "sizes",
    "fixed (ms)",
    "allowed (ms)",
    "bare (ms)",
    "bandwidth (GB/s)",
    "verified ceiling (GB/s)",
    "ratio",
    "floor",
    "verdict",
)


def fit_cells(fit: PathFit) -> list[str]:
    """One fitted row's cells in FIT_COLUMNS order."""
    line, ceil = fit.line, fit.ceiling
    return [
        fit.path,
        str(fit.receivers),
        str(len(fit.sizes)),
        "–" if line is None else f"{line.fixed_s * 1e3:.2f}",
        f"{fit.fixed_allowed_s * 1e3:g}",
        "–" if fit.bare_s is None else f"{fit.bare_s * 1e3:.2f}",
        "–" if line is None else f"{line.bandwidth_gbs:.3f}",
        "–" if ceil is None else f"{ceil.bandwidth_gbs:.3f}",
        f"{fit.bandwidth_ratio:.2f}",
        f"{fit.bandwidth_floor:g} ({fit.floor_source})",
        fit.verdict,
    ]
