"""The certification bundle: results.json a machine reads (docs/results-schema.md), junit.xml for CI, and
report.md / report.html a person reads; and the one verdict that both the report and the exit status carry.

The verdict weighs every piece of evidence (Jepsen's rule: unknown is never ok):
FAIL if anything showed a failure (a test, a fault cell, a throughput row with #wrong > 0 or below its
floor); else COULD NOT DECIDE if any evidence is missing (a suite crashed, was killed or wrote no results,
a cell is unknown, the throughput could not be measured, or nothing at all was shown); else PASS.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import shlex
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from harness.bench import THROUGHPUT_COLUMNS, SyncRow, gate_failures, throughput_cells

# test module -> the invariant of DESIGN.md it checks
INVARIANTS: dict[str, str] = {
    "test_bitwise": "1 bitwise (dtypes, shapes, NaN, -0.0)",
    "test_model_updates": "1 bitwise (model, trainer versions)",
    "test_buckets": "1 bitwise across buckets (tiny/unaligned units, oversize tensors, reuse)",
    "test_lifecycle_stateful": "3+5 version monotonicity, lifecycle order",
    "test_bad_input": "5 bad input refused, nothing lost",
    "test_pause_resume": "6 pause/resume, no mixing, nothing lost (queue beyond the batch)",
    "test_cache_invalidation": "4 caches invalidated (idle; under wait/keep traffic)",
    "test_computed_output": "1+4 computes like an independent forward (tied head; kept/waited tokens)",
    "test_in_place_load": "1+3 in-place load: rollback bit for bit, commit invalidates",
    "test_patch": "2 patch: base + delta exact (special values), wrong base / replay refused",
    "test_ipc_handles": "8 resources: handles released, stale/foreign refused",
    "test_resources": "8 resources: nothing grows with the number of syncs",
    "test_supervision": "7 dead or hung rank fails in bounded time",
    "test_torchrun": "broadcast rank code under torchrun",
}


#: Version of results.json's layout (docs/results-schema.md); bumped when a field changes meaning or goes.
SCHEMA_VERSION = 1

PASS, FAIL, UNDECIDED = "PASS", "FAIL", "COULD NOT DECIDE"
#: The exit status of `weightsync certify` for each verdict (2 is a usage error: nothing ran).
EXIT_STATUS = {PASS: 0, FAIL: 1, UNDECIDED: 3}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version_of(dist: str) -> str | None:
    """The installed version of a distribution, without importing it (vLLM's import takes seconds)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The machine and the software that produced a run (results.json's `environment`)."""
    env: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": _version_of("vllm"),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "gpus": [],
        "nccl": None,
    }
    if env["cuda"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):  # a build without NCCL
            env["nccl"] = None
    return env


@dataclasses.dataclass
class Decision:
    """The verdict and the evidence behind it: what failed, and what could not be established."""

    failed: list[str] = dataclasses.field(default_factory=list)
    undecided: list[str] = dataclasses.field(default_factory=list)

    @property
    def verdict(self) -> str:
        return FAIL if self.failed else UNDECIDED if self.undecided else PASS

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]


def known_failures(results: dict, faults: dict | None = None) -> list[tuple[str, str, str]]:
    """(backend, test, reason) of every strict xfail from an xfails file: failures of the code under test
    the user declared known. They do not fail the verdict; an XPASS (fixed, still listed) does."""
    return [
        (b, nodeid, rec.get("reason", ""))
        for suite in (results, faults or {})
        for b, res in suite.items()
        for nodeid, rec in res.get("tests", {}).items()
        if rec.get("status") == "xfailed"
    ]


def known_failures_section(results: dict, faults: dict | None = None) -> list[str]:
    known = known_failures(results, faults)
    if not known:
        return []
    md = [
        "",
        "## Known failures",
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


def _judge_suite(label: str, res: dict, decision: Decision, must_show: bool) -> None:
    """One suite run (the results JSON of harness.pytest_plugin, as run_conformance returns it)."""
    tests = res.get("tests", {})
    statuses = Counter(rec.get("status", "unknown") for rec in tests.values())
    for nodeid, rec in tests.items():
        status = rec.get("status", "unknown")
        cell = rec.get("fault_cell") or {}
        if status in ("failed", "error", "xpassed") or cell.get("verdict") == "fail":
            decision.failed.append(f"{label}: {nodeid} {status}")
        elif status == "unknown" or cell.get("verdict") == "unknown":
            decision.undecided.append(f"{label}: {nodeid} unknown (the outcome could not be established)")
    exitstatus = res.get("exitstatus", 0)
    if res.get("error"):
        decision.undecided.append(f"{label}: {res['error']}")
    elif not res.get("complete", True):
        decision.undecided.append(f"{label}: pytest stopped during {res.get('running') or 'teardown'}")
    elif exitstatus == 1 and not statuses["failed"] + statuses["error"]:
        decision.failed.append(f"{label}: pytest exited 1 with no test failed (an error in a teardown?)")
    elif exitstatus not in (0, 1, 5):
        decision.undecided.append(f"{label}: pytest exited {exitstatus} (interrupted or internal error)")
    if must_show and not res.get("error") and not statuses["passed"]:
        decision.undecided.append(
            f"{label}: nothing was shown (no test passed: {dict(statuses) or 'no tests'})"
        )


def decide(
    results: dict[str, dict],
    faults: dict[str, dict] | None = None,
    rows: list | None = None,
    missing: list[str] | tuple[str, ...] = (),
) -> Decision:
    """The verdict from every piece of evidence: conformance runs, fault runs, throughput rows, and
    `missing` (evidence that could not be taken, e.g. a throughput measurement that raised)."""
    decision = Decision()
    for backend, res in results.items():
        _judge_suite(f"conformance {backend}", res, decision, must_show=True)
    for backend, res in (faults or {}).items():
        _judge_suite(f"faults {backend}", res, decision, must_show=False)
    for r in rows or []:
        if not r.passed:
            decision.failed.append(
                f"throughput {r.path} {r.receivers}rx {r.size_bytes} B: {r.verdict} "
                f"(#wrong {r.wrong}, ratio {r.ratio:.3f}, floor {r.floor or '-'})"
            )
    decision.undecided += list(missing)
    if not results and not faults and not rows:
        decision.undecided.append("no evidence: nothing was run")
    return decision


def pytest_rerun(
    nodeid: str, backend: str, engine: str, receivers: str, profile: str = "ci", seed: int | None = None
) -> str:
    """The command that reruns one test alone (run from the repository root, as certify runs it)."""
    cmd = [
        "python",
        "-m",
        "pytest",
        nodeid,
        f"--weightsync-backend={backend}",
        f"--weightsync-engine={engine}",
        f"--weightsync-receivers={receivers}",
    ]
    if seed is not None:
        cmd.append(f"--weightsync-fault-seed={seed}")
    if profile != "ci":
        cmd.append(f"--weightsync-hypothesis-profile={profile}")
    return shlex.join(cmd)


def bench_rerun(row: Any, engine: str = "reference", repeats: int = 3) -> str:
    """The `weightsync bench` command that remeasures one throughput row (SyncRow)."""
    cmd = [
        "weightsync",
        "bench",
        "--backend",
        row.path,
        "--sizes-mib",
        str(max(1, round(row.size_bytes / 2**20))),
        "--receivers",
        str(row.receivers),
        "--repeats",
        str(repeats),
    ]
    if row.changed:
        cmd += ["--delta-fractions", f"{row.changed:g}"]
    if row.floor:
        cmd += ["--floor", f"{row.path}={row.floor:g}"]
    if engine != "reference":
        cmd += ["--engine", engine]
    return shlex.join(cmd)


def reruns(
    results: dict[str, dict],
    faults: dict[str, dict],
    rows: list,
    engine: str,
    receivers: str,
    profile: str = "ci",
    repeats: int = 3,
    bench_engine: str | None = None,
) -> list[dict[str, str]]:
    """One rerun line per failed (or unknown) test and per failed throughput row (remeasured with
    `bench_engine`, the engine the rows were measured with; default `engine`)."""
    out = []
    for suite, runs in (("conformance", results), ("faults", faults)):
        for backend, res in runs.items():
            for nodeid, rec in res.get("tests", {}).items():
                cell = rec.get("fault_cell") or {}
                if rec.get("status") in ("failed", "error", "xpassed", "unknown") or cell.get("verdict") in (
                    "fail",
                    "unknown",
                ):
                    cmd = pytest_rerun(nodeid, backend, engine, receivers, profile, cell.get("seed"))
                    out.append({"suite": suite, "what": f"{backend}: {nodeid}", "command": cmd})
    for r in rows:
        if not r.passed:
            what = f"{r.path} {r.receivers}rx {r.size_bytes} B ({r.verdict})"
            command = bench_rerun(r, bench_engine or engine, repeats)
            out.append({"suite": "throughput", "what": what, "command": command})
    return out


def merge_junit(out_dir: Path, target: Path) -> dict[str, int]:
    """Merge the per-suite junit-*.xml files pytest wrote into one <testsuites> file; returns its totals.
    Each <testsuite> is renamed after its file (junit-conformance-disk.xml -> conformance-disk)."""
    root = ET.Element("testsuites", name="weightsync certify")
    totals = Counter()
    for path in sorted(out_dir.glob("junit-*.xml")):
        try:
            tree = ET.parse(path).getroot()
        except ET.ParseError:
            continue  # a run killed mid-write; its absence is in the verdict already
        suites = [tree] if tree.tag == "testsuite" else list(tree.iter("testsuite"))
        for suite in suites:
            suite.set("name", path.stem.removeprefix("junit-"))
            for key in ("tests", "failures", "errors", "skipped"):
                totals[key] += int(suite.get(key, 0))
            totals["time"] += float(suite.get("time", 0))
            root.append(suite)
    for key, value in totals.items():
        root.set(key, f"{value:.3f}" if key == "time" else str(value))
    ET.ElementTree(root).write(target, encoding="utf-8", xml_declaration=True)
    return {k: v for k, v in totals.items() if k != "time"}


def invariant_of(nodeid: str) -> str:
    module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return INVARIANTS.get(module, module)


def matrix(results: dict[str, dict]) -> dict[str, dict[str, Counter]]:
    """invariant -> backend -> Counter of statuses."""
    out: dict[str, dict[str, Counter]] = {}
    for backend, res in results.items():
        for nodeid, rec in res.get("tests", {}).items():
            out.setdefault(invariant_of(nodeid), {}).setdefault(backend, Counter())[
                rec.get("status", "unknown")
            ] += 1
    return out


def cell(c: Counter | None) -> str:
    if not c:
        return "–"
    total = sum(c.values())
    if c.get("failed"):
        return f"**FAIL** {c['failed']}/{total}"
    if c.get("passed", 0) == 0 and c.get("not_supported"):
        return "NOT_SUPPORTED"
    extra = f" ({c['not_supported']} n/s)" if c.get("not_supported") else ""
    return f"PASS {c.get('passed', 0)}/{total}{extra}"


def fault_matrix(faults: dict[str, dict]) -> dict[str, dict[str, list[dict]]]:
    """fault kind -> backend -> the cells (one per seed) from the fault suite's results JSON."""
    out: dict[str, dict[str, list[dict]]] = {}
    for backend, res in faults.items():
        for rec in res.get("tests", {}).values():
            c = rec.get("fault_cell")
            if c is None:
                continue
            c = {**c, "status": rec.get("status")}
            out.setdefault(c["fault"], {}).setdefault(backend, []).append(c)
    return out


def between_syncs_kinds(mat: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The kinds of a fault matrix that damage the deployment between syncs (rows of their own)."""
    return [
        k
        for k, row in mat.items()
        if any(c.get("family") == "between-syncs" for cs in row.values() for c in cs)
    ]


def damage_of(kind: str) -> str:
    """The first sentence of the fault kind's own description (what it does to the deployment)."""
    from harness.faults.injectors import FAULTS

    doc = (FAULTS[kind].__doc__ or kind) if kind in FAULTS else kind
    return " ".join(doc.split()).split(". ")[0].split(": ")[0].rstrip(".").replace("|", "/")


def fault_cell_text(cells: list[dict] | None) -> str:
    """ok / **FAIL** / unknown / NOT_SUPPORTED, with the worst time to detect and to recover."""
    if not cells:
        return "–"
    verdicts = [c["verdict"] for c in cells]
    if "fail" in verdicts:
        return f"**FAIL** {verdicts.count('fail')}/{len(cells)}"
    if "unknown" in verdicts:
        return f"unknown {verdicts.count('unknown')}/{len(cells)}"
    if all(v == "not_applicable" for v in verdicts):
        return "NOT_SUPPORTED"
    detect = max(c["detect_s"] or 0 for c in cells)
    recover = max(c["recover_s"] or 0 for c in cells)
    return f"ok {verdicts.count('ok')}/{len(cells)} ({detect:.1f}s / {recover:.1f}s)"


def fault_section(faults: dict[str, dict]) -> list[str]:
    mat = fault_matrix(faults)
    if not mat:
        return []
    backends = list(faults)
    timeout = next((c["timeout_s"] for row in mat.values() for cs in row.values() for c in cs), None)
    md = [
        "",
        "## Fault matrix",
        "",
        f"Each cell: push v1, push v2 under the fault, heal, push v3 (timeout {timeout:g}s). ok = every engine served "
        "one committed version bit for bit, the failing push returned within 2x the timeout with a specific error "
        "naming the receiver, nothing reported success while engines differed, v3 reached every engine without a "
        "redeploy, nothing leaked. Times: slowest faulty push (detect) / slowest push after heal (recover). "
        "unknown never counts as ok.",
        "",
        "| fault | " + " | ".join(backends) + " |",
        "| --- | " + " | ".join("---" for _ in backends) + " |",
    ]
    between = between_syncs_kinds(mat)
    for kind in mat:
        if kind not in between:
            md.append(f"| {kind} | " + " | ".join(fault_cell_text(mat[kind].get(b)) for b in backends) + " |")
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
            "| damage | what is damaged | " + " | ".join(backends) + " |",
            "| --- | --- | " + " | ".join("---" for _ in backends) + " |",
        ]
        for kind in between:
            md.append(
                f"| {kind} | {damage_of(kind)} | "
                + " | ".join(fault_cell_text(mat[kind].get(b)) for b in backends)
                + " |"
            )
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


def plot_throughput(rows: list[SyncRow], path: Path) -> bool:
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Left: what each path achieves, its ceiling dashed in the same colour. Right: the ratio, which is
    # what a gate compares (ceilings differ by 10x between paths, so the left panel is log-scaled).
    fig, (bw, ratio) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (name, rx), group in _group(rows).items():
        xs = [r.size_bytes / 2**20 for r in group]
        (line,) = bw.plot(xs, [r.algbw_gbs for r in group], marker="o", label=f"{name} {rx}rx")
        bw.plot(xs, [r.ceiling_gbs for r in group], linestyle="--", alpha=0.5, color=line.get_color())
        ratio.plot(xs, [r.ratio for r in group], marker="o", color=line.get_color(), label=f"{name} {rx}rx")
    for ax in (bw, ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("payload (MiB)")
        ax.grid(alpha=0.3)
    bw.set_yscale("log")
    bw.set_ylabel("GB/s (dashed: ceiling)")
    bw.set_title("algbw per path")
    ratio.set_ylabel("algbw / ceiling")
    ratio.set_title("ratio to the transport's own ceiling")
    ratio.axhline(1.0, color="grey", linewidth=0.8)
    ratio.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _group(rows: list[SyncRow]) -> dict[tuple[str, int], list[SyncRow]]:
    out: dict[tuple[str, int], list[SyncRow]] = {}
    for r in rows:
        out.setdefault((r.path, r.receivers), []).append(r)
    return out


def throughput_table(rows: list[SyncRow]) -> list[str]:
    """The throughput rows as a Markdown table (columns and cells: bench.throughput_cells)."""
    align = ["---" if c in ("path", "type", "verdict") else "--:" for c in THROUGHPUT_COLUMNS]
    return [
        "| " + " | ".join(cells) + " |" for cells in (THROUGHPUT_COLUMNS, align, *map(throughput_cells, rows))
    ]


def throughput_section(rows: list[SyncRow], out_dir: Path) -> list[str]:
    """The sync table with its gate and where the time goes, plots drawn into out_dir (certify and bench)."""
    md = [
        "",
        "## Sync throughput",
        "",
        "Full lifecycle per push (start, prepare, transfer, finish on every engine), median of repeats; "
        "algbw = bytes / time; ceiling = the raw transport on this machine, two repeats before each push, "
        "the fastest kept (disk: write+fsync, then every receiver process maps the files; broadcast: bare gloo broadcast of "
        "the path's own messages to receiver processes; ipc: memcpy); #wrong = tensors not bitwise equal after the timed pushes. A row "
        "of 64 MiB and up fails below its floor; a ratio above 1.0 is **unreliable** (not passed).",
        "",
    ]
    md += throughput_table(rows)
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


def plot_breakdown(rows: list[SyncRow], path: Path) -> bool:
    """One stacked bar per row: the critical path of its median push, part by part (harness.bench.BAR_PARTS),
    with the ceiling's time for the same bytes as a tick."""
    rows = [r for r in rows if r.parts]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.bench import BAR_PARTS

    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.2))
    labels = [f"{r.path}\n{r.receivers}rx {r.size_bytes / 2**20:.0f}M" for r in rows]
    bottom = [0.0] * len(rows)
    colours = plt.get_cmap("tab10")
    for k, part in enumerate(BAR_PARTS):
        heights = [r.parts.get(part, 0.0) * 1e3 for r in rows]
        ax.bar(
            labels, heights, bottom=bottom, label=part, color=colours(k) if part != "other" else "lightgrey"
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ceilings = [r.size_bytes / r.ceiling_gbs / 1e6 if r.ceiling_gbs else None for r in rows]
    xs = [i for i, c in enumerate(ceilings) if c]
    ax.scatter(xs, [ceilings[i] for i in xs], marker="_", s=600, color="black", zorder=3, label="ceiling")
    ax.set_ylabel("ms (median push)")
    ax.set_title("where a sync's time goes (critical path)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(
    out_dir: Path,
    results: dict[str, dict],
    rows: list[SyncRow],
    command: str,
    faults: dict[str, dict] | None = None,
    *,
    engine: str = "reference",
    receivers: str = "auto",
    profile: str = "ci",
    repeats: int = 3,
    throughput_engine: str | None = None,
    throughput_note: str = "",
    missing: list[str] | tuple[str, ...] = (),
) -> Path:
    """Write the bundle into out_dir: results.json (docs/results-schema.md), junit.xml (the per-suite
    junit-*.xml merged), report.md (+ its PNG plots) and report.html (self-contained); returns report.md.
    The verdict is decide()'s, over every piece of evidence; `missing` is evidence that could not be taken."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    faults = faults or {}
    decision = decide(results, faults, rows, missing)
    junit = merge_junit(out_dir, out_dir / "junit.xml")
    fault_seeds = sorted(
        {
            rec["fault_cell"]["seed"]
            for res in faults.values()
            for rec in res.get("tests", {}).values()
            if rec.get("fault_cell") and rec["fault_cell"].get("seed") is not None
        }
    )
    data = {
        "schema_version": SCHEMA_VERSION,
        "run_id": out_dir.name,
        "verdict": decision.verdict,
        "exit_status": decision.exit_status,
        "reasons": {"failed": decision.failed, "undecided": decision.undecided},
        "reruns": reruns(results, faults, rows, engine, receivers, profile, repeats, throughput_engine),
        "command": command,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": env,
        "engine": engine,
        "receivers": receivers,
        "seeds": {"hypothesis_profile": profile, "fault_seeds": fault_seeds, "payload_seed": 0},
        "conformance": results,
        "faults": faults,
        "throughput": [r.to_json() for r in rows],
        "throughput_engine": throughput_engine if rows else None,
        "throughput_note": throughput_note,
        "throughput_gate": {"failed": gate_failures(rows)},
        "junit": junit,
    }
    (out_dir / "results.json").write_text(json.dumps(data, indent=2, sort_keys=True))

    backends = list(results)
    mat = matrix(results)
    md = [
        f"# weightsync certification: {data['verdict']}",
        "",
        f"- command: `{command}`",
        f"- generated: {data['generated_at']} on `{env['host']}` ({env['platform']}, {env['cpus']} CPUs, "
        f"torch {env['torch']}, CUDA {'yes' if env['cuda'] else 'no'})",
        f"- exit status: {decision.exit_status} (0 PASS, 1 FAIL, 3 COULD NOT DECIDE)",
    ]
    md += verdict_section(data)
    md += [
        "",
        "## What was under test",
        "",
        "| backend | engine | receivers | hypothesis profile | capabilities |",
        "| --- | --- | --- | --- | --- |",
    ]
    for b in backends:
        r = results[b]
        caps = ", ".join(f"{k}={v}" for k, v in r.get("capabilities", {}).get(b, {}).items())
        rx = r.get("receivers", {}).get(b)
        md.append(f"| {b} | `{r.get('engine')}` | {rx} | {r.get('hypothesis_profile')} | {caps} |")
    md += [
        "",
        "## Invariants × paths",
        "",
        "| invariant | " + " | ".join(backends) + " |",
        "| --- | " + " | ".join("---" for _ in backends) + " |",
    ]
    for inv in sorted(mat):
        md.append(f"| {inv} | " + " | ".join(cell(mat[inv].get(b)) for b in backends) + " |")
    failures = [
        (b, n, rec)
        for b in backends
        for n, rec in results[b].get("tests", {}).items()
        if rec.get("status") in ("failed", "error")
    ]
    stopped = [(b, results[b]["error"]) for b in backends if results[b].get("error")]
    if failures or stopped:
        md += ["", "## Failures", ""]
        md += [f"- **{b}**: {err}" for b, err in stopped]
        for b, n, rec in failures:
            rerun = pytest_rerun(n, b, engine, receivers, profile)
            md += [f"### {b}: `{n}`", "", f"rerun: `{rerun}`", "", "```", rec.get("message", "")[-1500:]]
            md += ["```", ""]
    md += known_failures_section(results, faults)
    md += fault_section(faults)
    examples = {
        b: sum(rec.get("examples", 0) for rec in results[b].get("tests", {}).values()) for b in backends
    }
    counts = {b: Counter(rec.get("status") for rec in results[b].get("tests", {}).values()) for b in backends}
    md += [
        "",
        "## Counts",
        "",
        "| backend | tests | passed | failed | NOT_SUPPORTED | skipped | hypothesis examples |",
        "| --- | --: | --: | --: | --: | --: | --: |",
    ]
    for b in backends:
        c = counts[b]
        md.append(
            f"| {b} | {sum(c.values())} | {c['passed']} | {c['failed'] + c['error']} | {c['not_supported']} | "
            f"{c['skipped']} | {examples[b]} |"
        )
    if rows or throughput_note:
        md += ["", "## Sync throughput", "", f"**{throughput_note}**" if throughput_note else ""]
    if rows:
        md += throughput_section(rows, out_dir)[2:]  # the heading is above, with the engine it measured
        md += [
            "",
            "## Cost model",
            "",
            "GPU-hours spent in sync = sync seconds × GPUs held × steps / 3600, "
            "for the largest payload measured per path, at 8 GPUs held and 1000 steps:",
            "",
            "| path | rx | size (B) | sync (s) | GPU-hours / 1000 steps on 8 GPUs |",
            "| --- | --: | --: | --: | --: |",
        ]
        for (name, rx), group in _group(rows).items():
            r = max(group, key=lambda row: row.size_bytes)
            md.append(
                f"| {name} | {rx} | {r.size_bytes} | {r.time_s:.4f} | {r.time_s * 8 * 1000 / 3600:.3f} |"
            )
    md.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    from harness.report_html import render

    (out_dir / "report.html").write_text(render(data, rows, out_dir))
    return path


def verdict_section(data: dict) -> list[str]:
    """Why the verdict is what it is, and the command that reruns each failure alone."""
    md = []
    reasons = data["reasons"]
    if reasons["failed"] or reasons["undecided"]:
        md += ["", "## Why", ""]
        md += [f"- **failed** {r}" for r in reasons["failed"]]
        md += [f"- **could not decide** {r}" for r in reasons["undecided"]]
    if data["reruns"]:
        md += ["", "## Rerun a failure alone", "", "From the repository root:", ""]
        for r in data["reruns"]:
            md += [f"- {r['suite']} {r['what']}:", f"  `{r['command']}`"]
    return md
