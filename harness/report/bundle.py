"""The certification bundle in a folder: results.json a machine reads (docs/results-schema.md), one merged
junit.xml for CI, report.md and report.html a person reads: all written from one computed verdict."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from harness.bench import SyncRow, gate_failures
from harness.report.evidence import (
    SCHEMA_VERSION,
    cell,
    decide,
    environment,
    jobs_text,
    matrix,
    pytest_rerun,
    quick_skipped,
    reruns,
    verdict_label,
)
from harness.report.html_page import render
from harness.report.markdown_page import (
    fault_section,
    known_failures_section,
    quick_section,
    reshard_section,
    throughput_section,
    verdict_section,
)
from harness.report.plots import rows_by_path
from harness.throughput_model import fit_paths


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
    jobs: int = 1,
    quick: dict | None = None,
) -> Path:
    """Write the bundle into out_dir: results.json (docs/results-schema.md), junit.xml (the per-suite
    junit-*.xml merged), report.md (+ its PNG plots) and report.html (self-contained); returns report.md.
    The verdict is decide()'s, over every piece of evidence; `missing` is evidence that could not be taken.
    `jobs`: the xdist workers each suite ran on (1: one test at a time). `quick`: a certify --quick run's
    `full_command`, `sizes_mib` and `repeats` (what it left out is read from the suites' results)."""
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
        "throughput_fits": [f.to_json() for f in fit_paths(rows)],
        "junit": junit,
        "jobs": jobs,
        "verdict_label": verdict_label(decision.verdict, bool(quick)),
        "quick": None,
    }
    if quick:
        skipped = quick_skipped(results, faults)
        total = sum(len(ids) for by in skipped.values() for ids in by.values())
        data["quick"] = {**quick, "skipped": skipped, "total": total}
    (out_dir / "results.json").write_text(json.dumps(data, indent=2, sort_keys=True))

    backends = list(results)
    mat = matrix(results)
    md = [
        f"# weightsync certification: {data['verdict_label']}",
        "",
        f"- command: `{command}`",
        f"- {jobs_text(jobs)}",
        f"- generated: {data['generated_at']} on `{env['host']}` ({env['platform']}, {env['cpus']} CPUs, "
        f"torch {env['torch']}, CUDA {'yes' if env['cuda'] else 'no'})",
        f"- exit status: {decision.exit_status} (0 PASS, 1 FAIL, 3 COULD NOT DECIDE)",
    ]
    md += verdict_section(data)
    md += quick_section(data)
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
            rerun = pytest_rerun(n, b, engine, receivers, profile, device=results[b].get("device", "cpu"))
            md += [f"### {b}: `{n}`", "", f"rerun: `{rerun}`", "", "```", rec.get("message", "")[-1500:]]
            md += ["```", ""]
    md += known_failures_section(results, faults)
    md += fault_section(faults)
    md += reshard_section(results)
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
        for (name, rx), group in rows_by_path(rows).items():
            r = max(group, key=lambda row: row.size_bytes)
            md.append(
                f"| {name} | {rx} | {r.size_bytes} | {r.time_s:.4f} | {r.time_s * 8 * 1000 / 3600:.3f} |"
            )
    md.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    (out_dir / "report.html").write_text(render(data, rows, out_dir))
    return path
