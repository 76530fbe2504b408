"""The performance report of `weightsync bench`: the sync table with its gate, where the time goes, and the
scaling tables (time against payload size, against receivers, delta against dense by changed fraction, and
with --bucket-mib time against bucket size), each drawn as well as tabulated."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

from harness.bench import DEFAULT_CHANGED, SyncRow, busy_rows, gate_failures
from harness.report import environment, throughput_section
from harness.report.plots import pyplot, save_figure
from harness.throughput_model import fit_paths


def receivers_table(rows: list[SyncRow]) -> list[str]:
    """Time against receivers at each size: a broadcast should stay flat, a copy per receiver grows."""
    dense = [r for r in rows if not r.changed]
    counts = sorted({r.receivers for r in dense})
    if len(counts) < 2:
        return []
    lines = [
        "| path | size (MiB) | "
        + " | ".join(f"{n} rx (ms)" for n in counts)
        + f" | {counts[-1]} rx / 1 rx |",
        "| --- | --: | " + " | ".join("--:" for _ in counts) + " | --: |",
    ]
    for path, size in sorted({(r.path, r.size_bytes) for r in dense}):
        by = {r.receivers: r.time_s for r in dense if r.path == path and r.size_bytes == size}
        if len(by) < 2:
            continue
        growth = f"{by[max(by)] / by[min(by)]:.2f}" if min(by) == counts[0] else "–"
        lines.append(
            f"| {path} | {size / 2**20:.0f} | "
            + " | ".join(f"{by[n] * 1e3:.1f}" if n in by else "–" for n in counts)
            + f" | {growth} |"
        )
    return lines


@functools.cache
def dense_path_of(name: str) -> str:
    """The dense path a delta path rides on, what it must beat: its Backend's `dense_path` (broadcast for
    a path the registry cannot name)."""
    from harness.api import BackendError
    from harness.registry import resolve_backend

    try:
        return resolve_backend(name, "cpu").dense_path or "broadcast"
    except BackendError:
        return "broadcast"


def crossover_table(rows: list[SyncRow]) -> tuple[list[str], dict[str, float | None]]:
    """Delta rows by changed fraction against their dense path's time at the same size and receivers; a
    path's crossover is the first fraction at which delta is no faster (None: it paid at every one)."""
    deltas = sorted(
        (r for r in rows if r.changed), key=lambda r: (r.path, r.receivers, r.size_bytes, r.changed)
    )
    dense = {(r.path, r.size_bytes, r.receivers): r for r in rows if not r.changed}
    lines = [
        "| delta path | rx | size (MiB) | changed | delta (ms) | dense path | dense (ms) | delta / dense |",
        "| --- | --: | --: | --: | --: | --- | --: | --: |",
    ]
    crossover: dict[str, float | None] = {}
    swept: dict[str, tuple] = {}  # per delta path: the (receivers, size) with the most fractions measured
    for r in deltas:
        key = (r.receivers, r.size_bytes)
        n = sum(1 for x in deltas if x.path == r.path and (x.receivers, x.size_bytes) == key)
        if n > swept.get(r.path, ((), 0))[1]:
            swept[r.path] = (key, n)
    for r in deltas:
        base = dense_path_of(r.path)
        d = dense.get((base, r.size_bytes, r.receivers))
        if d is None:
            continue
        ratio = r.time_s / d.time_s
        if (r.receivers, r.size_bytes) == swept[r.path][0]:
            crossover.setdefault(r.path, None)
            if ratio >= 1.0 and crossover[r.path] is None:
                crossover[r.path] = r.changed
        lines.append(
            f"| {r.path} | {r.receivers} | {r.size_bytes / 2**20:.0f} | {r.changed:.1%} | "
            f"{r.time_s * 1e3:.1f} | {base} | {d.time_s * 1e3:.1f} | {ratio:.2f} |"
        )
    return (lines if len(lines) > 2 else []), crossover


def _crossover_text(c: float | None, rows: list[SyncRow], path: str) -> str:
    smallest = min((r.changed for r in rows if r.path == path and r.changed), default=None)
    if c is not None and c == smallest:
        return f"none: delta was slower than dense already at {c:.1%}, the smallest fraction measured"
    if c is None:
        return "beyond the sweep (delta paid at every fraction measured)"
    return f"{c:.1%}"


def bucket_table(rows: list[SyncRow]) -> list[str]:
    """The bucket sweep's rows (bucket_bytes set): per path and size, time and ratio to the ceiling of the
    same bucket plan at each bucket size, and the fastest size."""
    swept = [r for r in rows if r.bucket_bytes]
    units = sorted({r.bucket_bytes for r in swept})
    if not units:
        return []
    lines = [
        "| path | rx | size (MiB) | tensors | "
        + " | ".join(f"{u / 2**20:g} MiB: ms (ratio)" for u in units)
        + " | fastest |",
        "| --- | --: | --: | --: | " + " | ".join("--:" for _ in units) + " | --: |",
    ]
    for path, rx, size, count in sorted({(r.path, r.receivers, r.size_bytes, r.count) for r in swept}):
        by = {
            r.bucket_bytes: r
            for r in swept
            if (r.path, r.receivers, r.size_bytes, r.count) == (path, rx, size, count)
        }
        fastest = min(by.values(), key=lambda r: r.time_s).bucket_bytes
        lines.append(
            f"| {path} | {rx} | {size / 2**20:.0f} | {count} | "
            + " | ".join(f"{by[u].time_s * 1e3:.1f} ({by[u].ratio:.2f})" if u in by else "–" for u in units)
            + f" | {fastest / 2**20:g} MiB |"
        )
    return lines


def _time_lines(ax, rows: list[SyncRow], group, x, label) -> None:
    """One line of median push time (ms) against x(row) per group of rows, in group order."""
    groups: dict[tuple, list[SyncRow]] = {}
    for r in rows:
        groups.setdefault(group(r), []).append(r)
    for key, members in sorted(groups.items()):
        members.sort(key=x)
        ax.plot([x(r) for r in members], [r.time_s * 1e3 for r in members], marker="o", label=label(key))


def plot_buckets(rows: list[SyncRow], path: Path) -> bool:
    """Time against bucket size (log x), one line per path (and size and receivers where several)."""
    swept = [r for r in rows if r.bucket_bytes]
    if not swept:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    _time_lines(
        ax,
        swept,
        group=lambda r: (r.path, r.size_bytes, r.receivers),
        x=lambda r: r.bucket_bytes / 2**20,
        label=lambda g: f"{g[0]} {g[1] / 2**20:.0f} MiB {g[2]}rx",
    )
    ax.set_xscale("log", base=2)
    units = sorted({r.bucket_bytes / 2**20 for r in swept})
    ax.set_xticks(units, [f"{u:g}" for u in units])  # the swept sizes, not powers of two
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("median push (ms)")
    ax.set_title("time against bucket size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)
    return True


def plot_scaling(rows: list[SyncRow], path: Path) -> bool:
    """Left: time against payload (log-log, one line per path and receiver count). Right: delta time over
    dense time against the changed fraction (below 1: delta pays)."""
    dense = [r for r in rows if not r.changed]
    deltas = [r for r in rows if r.changed]
    if not dense:
        return False
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    _time_lines(
        left,
        dense,
        group=lambda r: (r.path, r.receivers),
        x=lambda r: r.size_bytes / 2**20,
        label=lambda g: f"{g[0]} {g[1]}rx",
    )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("payload (MiB)")
    left.set_ylabel("median push (ms)")
    left.set_title("time against payload and receivers")
    left.grid(alpha=0.3)
    left.legend(fontsize=6, ncol=2)
    by_dense = {(r.path, r.size_bytes, r.receivers): r for r in dense}
    for name in sorted({r.path for r in deltas}):
        mine = [r for r in deltas if r.path == name]
        swept = max(
            {(r.receivers, r.size_bytes) for r in mine},
            key=lambda k: sum(1 for r in mine if (r.receivers, r.size_bytes) == k),
        )
        pts = sorted((r for r in mine if (r.receivers, r.size_bytes) == swept), key=lambda r: r.changed)
        base = dense_path_of(name)
        xs, ys = [], []
        for r in pts:
            d = by_dense.get((base, r.size_bytes, r.receivers))
            if d:
                xs.append(r.changed * 100)
                ys.append(r.time_s / d.time_s)
        if xs:
            right.plot(xs, ys, marker="o", label=f"{name} / {base}")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xscale("log")
    right.set_xlabel("entries changed per version (%)")
    right.set_ylabel("delta time / dense time")
    right.set_title("delta crossover (below 1: delta pays)")
    right.grid(alpha=0.3)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=7)
    save_figure(fig, path)
    return True


def write_perf_report(
    out_dir: Path, rows: list[SyncRow], command: str, generated_at: str | None = None, stopped: str = ""
) -> Path:
    """bench's bundle: results.json, report.md and the plots. `stopped`: why the run ended early; the rows
    are those measured before, and the verdict is STOPPED (never PASS: rows are missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    failed = gate_failures(rows)  # every row: a bucket row with #wrong > 0 fails the run too
    busy = busy_rows(rows)  # missed their floors while other jobs took the host's CPUs: not judged
    swept_buckets = [r for r in rows if r.bucket_bytes]
    everything, rows = rows, [r for r in rows if not r.bucket_bytes]  # the other tables: own units only
    crossover_lines, crossover = crossover_table(rows)
    data = {
        "verdict": "FAIL" if failed else "STOPPED" if stopped else "COULD NOT DECIDE" if busy else "PASS",
        **({"stopped": stopped} if stopped else {}),
        "command": command,
        "environment": env,
        "generated_at": generated_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "failed": failed,
        "undecided": busy,
        "delta_crossover": crossover,
        "rows": [r.to_json() for r in everything],
        "fits": [f.to_json() for f in fit_paths(everything)],
    }
    (out_dir / "results.json").write_text(json.dumps(data, indent=2, sort_keys=True))
    gated = [r for r in rows if r.changed in (0.0, DEFAULT_CHANGED)]  # the sweep's other fractions: below
    md = [
        f"# weightsync bench: {data['verdict']}",
        "",
        f"- command: `{command}`",
        *(
            [f"- **{stopped}**: the rows below are those measured before; the rest were not."]
            if stopped
            else []
        ),
        f"- generated: {data['generated_at']} on `{env['host']}` ({env['platform']}, {env['cpus']} CPUs, "
        f"torch {env['torch']})",
        "",
    ]
    md += throughput_section(gated, out_dir) if gated else []
    rx = receivers_table(rows)
    if rx:
        md += ["", "## Against receivers", ""] + rx
    if crossover_lines:
        md += [
            "",
            "## Delta against dense by changed fraction",
            "",
            "Crossover (the first changed fraction at which delta is no faster than the dense path it rides "
            "on): " + ", ".join(f"{p} {_crossover_text(c, rows, p)}" for p, c in crossover.items()) + ".",
            "",
        ]
        md += crossover_lines
    if plot_scaling(rows, out_dir / "scaling.png"):
        md += ["", "![scaling](scaling.png)"]
    buckets = bucket_table(swept_buckets)
    if buckets:
        md += [
            "",
            "## Time against bucket size",
            "",
            "Median push in ms at each bucket size (`--bucket-mib`), over a payload of ~1 MiB tensors (a bucket "
            "packs several; a tensor larger than a bucket goes whole); in brackets the ratio to the ceiling "
            "of the same bucket plan. Measured, not gated.",
            "",
        ] + buckets
        if plot_buckets(swept_buckets, out_dir / "buckets.png"):
            md += ["", "![buckets](buckets.png)"]
    md.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return path


def rows_from_results(path: Path) -> tuple[list[SyncRow], str]:
    """The rows and command of a results.json written by write_perf_report (to redraw a report)."""
    import dataclasses

    data = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(SyncRow)}
    return [SyncRow(**{k: v for k, v in r.items() if k in fields}) for r in data["rows"]], data["command"]


def redraw(out_dir: Path) -> Path:
    """Rewrite report.md and the plots of a bench directory from its results.json (same run, same figures)."""
    rows, command = rows_from_results(out_dir / "results.json")
    for r in rows:  # written before a part was renamed
        if "control" in r.parts:
            r.parts["other"] = r.parts.pop("control")
    return write_perf_report(
        out_dir, rows, command, json.loads((out_dir / "results.json").read_text())["generated_at"]
    )
