"""report.md's sections (known failures, the fault matrix, --quick's omissions, the throughput table, its
fit, floors and breakdown, the cost model, the appendix), drawn from the evidence; markdown_report puts
them in order under the first screen."""

from __future__ import annotations

from pathlib import Path

from harness.bench import THROUGHPUT_COLUMNS, SyncRow, throughput_cells
from harness.report.evidence import (
    RESHARD_COLUMN_MEANINGS,
    RESHARD_COLUMNS,
    between_syncs_kinds,
    damage_of,
    fault_cell_text,
    fault_matrix,
    floor_notes,
    known_failures,
    quick_throughput,
    reshard_bytes_rows,
    reshard_heading,
    reshard_plans,
)
from harness.report.plots import plot_breakdown, plot_throughput, rows_by_path
from harness.report.sections import RESHARD_FILE, SECTIONS, anchor, md_link
from harness.report.under_test import capability_table, under_test


def known_failures_section(results: dict, faults: dict | None = None) -> list[str]:
    known = known_failures(results, faults)
    if not known:
        return []
    md = [
        "",
        f"## {SECTIONS['known']}",
        "",
        "Listed in the xfails file: they failed as expected (a fix shows as XPASS,",
    ]
    md += [
        "which fails the verdict until the line goes).",
        "",
        "| backend | test | reason |",
        "| --- | --- | --- |",
    ]
    md += [f"| {b} | `{n}` | {reason.removeprefix('known failure: ')} |" for b, n, reason in known]
    return md


def _fault_table(first: str, second: str, kinds, mat: dict, backends: list[str]) -> list[str]:
    """The fault matrix's rows for `kinds` as a Markdown table: the kind, what it does, each backend's cell
    (the in-push faults and the damage between syncs are two such tables)."""
    md = [
        f"| {first} | {second} | " + " | ".join(backends) + " |",
        "| --- | --- | " + " | ".join("---" for _ in backends) + " |",
    ]
    for kind in kinds:
        md.append(
            f"| {kind} | {damage_of(kind)} | "
            + " | ".join(fault_cell_text(mat[kind].get(b)) for b in backends)
            + " |"
        )
    return md


def fault_section(faults: dict[str, dict]) -> list[str]:
    mat = fault_matrix(faults)
    if not mat:
        return []
    backends = list(faults)
    timeout = next((c["timeout_s"] for row in mat.values() for cs in row.values() for c in cs), None)
    md = [
        "",
        f"## {SECTIONS['faults']}",
        "",
        f"Each cell: push v1, push v2 under the fault, heal, push v3 (timeout {timeout:g}s). ok = every engine served "
        "one committed version bit for bit, the failing push returned within 2x the timeout with a specific error "
        "naming the receiver, nothing reported success while engines differed, v3 reached every engine without a "
        "redeploy, nothing leaked. Times: slowest faulty push (detect) / slowest push after heal (recover). "
        "unknown never counts as ok. A fraction counts the cells (one per point the fault was injected at) "
        "and says what else it holds: NOT_SUPPORTED, a point the backend does not claim what it needs.",
        "",
    ]
    between = between_syncs_kinds(mat)
    md += _fault_table("fault", "what is injected", [k for k in mat if k not in between], mat, backends)
    if between:
        md += [
            "",
            "### Damage between syncs",
            "",
            "After v1 committed, with nothing in flight, the machine damages the deployment; then v2 and v3 are "
            "pushed as the trainer would push them. ok = v2 committed bit for bit on every engine, or failed once "
            "with an error naming what was damaged (engines still on v1, bit for bit) and v3 committed: never "
            "every push failing until a redeploy, never a redeploy by the harness.",
            "",
        ]
        md += _fault_table("damage", "what is damaged", between, mat, backends)
    bad = [
        c for row in mat.values() for cs in row.values() for c in cs if c["verdict"] in ("fail", "unknown")
    ]
    for c in bad:
        md += [
            "",
            f"- **{c['verdict']}** {c['backend']} × {c['fault']} (seed {c['seed']}, {c['point']}): "
            + "; ".join(c["reasons"])[:1500],
        ]
    return md


def throughput_table(rows: list[SyncRow]) -> list[str]:
    """The throughput rows as a Markdown table (columns and cells: bench.throughput_cells)."""
    align = ["---" if c in ("path", "type", "verdict") else "--:" for c in THROUGHPUT_COLUMNS]
    return [
        "| " + " | ".join(cells) + " |" for cells in (THROUGHPUT_COLUMNS, align, *map(throughput_cells, rows))
    ]


def fit_section(rows: list[SyncRow]) -> list[str]:
    """Each path's time fitted as fixed + bytes / bandwidth (harness.throughput_model), beside its floors."""
    from harness.throughput_model import FIT_COLUMNS, fit_cells, fit_paths

    fits = fit_paths(rows)
    if not fits:
        return []
    align = ["---" if c in ("path", "floor", "verdict") else "--:" for c in FIT_COLUMNS]
    md = [
        "",
        "### Fixed cost and bandwidth",
        "",
        "Each path's median times fitted as `time = fixed + bytes / bandwidth` over its sizes (least squares; "
        "bare = the lifecycle with an empty payload). The bandwidth is judged against the verified "
        "ceiling's, fitted over the same sizes (ratio, floor and where the floor came from); the fixed cost "
        "against what the path may cost per sync (allowed).",
        "",
    ]
    md += ["| " + " | ".join(cells) + " |" for cells in (FIT_COLUMNS, align, *map(fit_cells, fits))]
    for fit in fits:
        md += [f"- **{fit.path} {fit.receivers}rx**: {why}" for why in fit.failures()]
    return md


def throughput_section(rows: list[SyncRow], out_dir: Path) -> list[str]:
    """The sync table with its gate and where the time goes, plots drawn into out_dir (certify and bench)."""
    md = [
        "",
        f"## {SECTIONS['throughput']}",
        "",
        "Full lifecycle per push (start, prepare, transfer, finish on every engine), median of repeats; "
        "algbw = bytes / time; ceiling = the raw transport on this machine, two repeats before each push, "
        "the fastest kept (disk: write+fsync, then every receiver process maps the files; broadcast: bare gloo broadcast of "
        "the path's own messages to receiver processes; ipc: memcpy; a GPU path: the copy on its GPU), shown as "
        "ratio = algbw / ceiling; verified = the ceiling plus the harness's digests on both sides (what a "
        "verified sync cannot beat); #wrong = tensors not bitwise equal after the timed pushes. A row fails "
        "when its time is over **allowed** = the fixed cost the path may spend + the verified ceiling's time "
        "/ the bandwidth floor; a ratio above 1.0 is **unreliable** (not passed). rx = receiver ranks, "
        "count = tensors, type = their dtype, bound = the ceiling's kind; each path's floors and why they "
        f"are what they are: {md_link('floors')}.",
        "",
    ]
    md += throughput_table(rows)
    md += fit_section(rows)
    md += floors_section(rows)
    if plot_throughput(rows, out_dir / "throughput.png"):
        md += ["", "![throughput](throughput.png)"]
    md += [
        "",
        "### Where the time goes",
        "",
        "ms of the median push. Steps: what the trainer waits on. Parts: the critical path — the "
        "trainer's prepare (digest, alloc, pack; wire when it writes files), the slowest receiver's "
        "transfer (wire, unpack, verify) and commit; other is the rest (RPC, locks, engine reads, Python).",
        "",
    ]
    md += breakdown_table(rows)
    fewest = min(r.receivers for r in rows)
    if plot_breakdown([r for r in rows if r.receivers == fewest], out_dir / "breakdown.png"):
        md += ["", f"![breakdown](breakdown.png) (bars: {fewest} receiver(s))"]
    return md


def breakdown_table(rows: list[SyncRow]) -> list[str]:
    """Where each row's median push went (ms): the steps the trainer waits on, and the critical path's parts."""
    from harness.bench import BAR_PARTS

    steps = ("start", "prepare", "transfer", "finish")
    lines = [
        "| path | rx | size (MiB) | " + " | ".join(steps) + " | " + " | ".join(BAR_PARTS) + " |",
        "| --- | --: | --: | " + " | ".join("--:" for _ in steps + BAR_PARTS) + " |",
    ]
    for r in rows:
        lines.append(
            f"| {r.path} | {r.receivers} | {r.size_bytes / 2**20:.0f} | "
            + " | ".join(f"{r.steps.get(k, 0.0) * 1e3:.1f}" for k in steps)
            + " | "
            + " | ".join(f"{r.parts.get(k, 0.0) * 1e3:.1f}" for k in BAR_PARTS)
            + " |"
        )
    return lines


def quick_section(data: dict) -> list[str]:
    """'Skipped by --quick': what the first look left out, counted by suite and backend, and the command
    of the full run."""
    quick = data.get("quick")
    if not quick:
        return []
    skipped = quick["skipped"]
    backends = sorted({b for by in skipped.values() for b in by})
    throughput = quick_throughput(quick)
    md = [
        "",
        f"## {SECTIONS['quick']}",
        "",
        "A first look: the conformance tests that take a second or more on a 2-core machine (marked "
        "`not_quick`), the tests of each backend at more receivers than its fewest, and every fault cell "
        "past its fault's first point (in the control column, also the faults of its data plane: disk's "
        f"column has them) were left out{throughput}. "
        f"{quick['total']} tests in all were not run. Their node ids are in results.json "
        "(`quick.skipped`). The full run:",
        "",
        f"    {quick['full_command']}",
        "",
        "| backend | conformance tests left out | fault cells left out |",
        "| --- | --: | --: |",
    ]
    md += [
        f"| {b} | {len(skipped['conformance'].get(b, []))} | {len(skipped['faults'].get(b, []))} |"
        for b in backends
    ]
    return md


def floors_section(rows: list[SyncRow]) -> list[str]:
    """Each gated path's two floors, where they came from (declared, default of its ceiling kind, --floor)
    and why they are what they are."""
    notes = floor_notes(rows)
    if not notes:
        return []
    md = ["", f"### {SECTIONS['floors']}", ""]
    return md + [f"- **{path}**: {text}" for path, text in notes]


def cost_section(rows: list[SyncRow]) -> list[str]:
    """GPU-hours spent in sync for the largest payload measured per path."""
    md = [
        "",
        f"## {SECTIONS['cost']}",
        "",
        "GPU-hours spent in sync = sync seconds × GPUs held × steps / 3600, "
        "for the largest payload measured per path (rx: its receiver ranks), at 8 GPUs held and 1000 steps:",
        "",
        "| path | rx | size (B) | sync (s) | GPU-hours / 1000 steps on 8 GPUs |",
        "| --- | --: | --: | --: | --: |",
    ]
    for (name, rx), group in rows_by_path(rows).items():
        r = max(group, key=lambda row: row.size_bytes)
        md.append(f"| {name} | {rx} | {r.size_bytes} | {r.time_s:.4f} | {r.time_s * 8 * 1000 / 3600:.3f} |")
    return md


def capabilities_appendix(results: dict, faults: dict) -> list[str]:
    """Every capability each backend declares, one row per capability (yes, –, or its value)."""
    tested = under_test(results, faults)
    if not tested:
        return []
    header, rows = capability_table(tested)
    md = ["", f"## {SECTIONS['capabilities']}", ""]
    md.append(
        "What each backend declares (`Capabilities`); a test of a capability it does not declare is "
        "NOT_SUPPORTED, never failed."
    )
    md += ["", "| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return md + ["| " + " | ".join(cells) + " |" for cells in rows]


def reshard_appendix(results: dict[str, dict]) -> list[str]:
    """The resharding plans test_reshard attached: bytes per rank against the plan's minimum (every
    transfer: RESHARD_FILE, reshard_page)."""
    plans = reshard_plans(results)
    if not plans:
        return []
    md = [
        "",
        f"## {SECTIONS['reshard']}",
        "",
        "Trainer FSDP2 / DTensor shards -> engine tensor-parallel shards (docs/resharding.md). planned = the "
        "bytes the plan moves from or to the rank; minimum = the checkpoint bytes each engine rank's shards "
        "hold (total: their sum); measured = what the sync counted; a rank whose measured bytes differ from "
        f"its minimum moved a byte twice or missed one. Every transfer: [{RESHARD_FILE}]({RESHARD_FILE}).",
    ]
    for backend, node, plan in plans:
        md += ["", f"`{node}` ({backend}): {reshard_heading(plan)}", ""]
        md += [
            "| rank | planned B | minimum B | measured B | measured = minimum |",
            "| --- | --: | --: | --: | --- |",
        ]
        md += ["| " + " | ".join(cells) + " |" for cells in reshard_bytes_rows(plan)]
        md += [
            "",
            *(
                f"- tied: `{a}` is `{b}` on every engine rank (no bytes of its own)"
                for a, b in plan.get("tied", {}).items()
            ),
        ]
    return md


def reshard_page(results: dict[str, dict]) -> str | None:
    """RESHARD_FILE: every transfer of every plan, its columns defined above the tables; None without a plan."""
    plans = reshard_plans(results)
    if not plans:
        return None
    md = [
        "# Resharding plan: every transfer",
        "",
        f"The transfers of [{SECTIONS['reshard']}](report.md{anchor('reshard')}) in report.md. Columns:",
        "",
        *(f"- {col}: {what}" for col, what in RESHARD_COLUMN_MEANINGS.items()),
    ]
    for backend, node, plan in plans:
        md += ["", f"## `{node}` ({backend})", "", reshard_heading(plan), ""]
        md += [
            "| # | " + " | ".join(RESHARD_COLUMNS) + " |",
            "| --: | " + " | ".join("---" for _ in RESHARD_COLUMNS) + " |",
        ]
        md += [
            f"| {i} | " + " | ".join(str(t[c]) for c in RESHARD_COLUMNS) + " |"
            for i, t in enumerate(plan["transfers"])
        ]
    return "\n".join([*md, ""])
