"""The certification bundle in a folder: results.json a machine reads (docs/results-schema.md), one merged
junit.xml for CI, report.md and report.html a person reads (and reshard-plan.md, the resharding plan's
every transfer, where a test attached one): all written from one computed verdict."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from harness.bench import SyncRow, gate_failures
from harness.report.evidence import (
    SCHEMA_VERSION,
    decide,
    environment,
    quick_skipped,
    reruns,
    verdict_label,
)
from harness.report.glance import glance
from harness.report.html_page import render
from harness.report.markdown_page import reshard_page
from harness.report.markdown_report import render_markdown
from harness.report.sections import RESHARD_FILE
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

    g = glance(data, rows, str(out_dir))
    path = out_dir / "report.md"
    path.write_text(render_markdown(data, rows, out_dir, g))
    (out_dir / "report.html").write_text(render(data, rows, out_dir, g))
    plan = reshard_page(results)
    if plan:
        (out_dir / RESHARD_FILE).write_text(plan)
    return path
