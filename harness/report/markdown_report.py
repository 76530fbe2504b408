"""report.md from top to bottom: the first screen (the verdict, what was shown, why, what to rerun), the
sections in reading order, then the appendix (capabilities; the resharding plan, whose every transfer goes
to a file of its own). The sections themselves are markdown_page's."""

from __future__ import annotations

from pathlib import Path

from harness.report.counts import COUNT_HEADER, count_rows, suite_counts
from harness.report.evidence import (
    INVARIANT_NUMBERS,
    cell,
    jobs_text,
    matrix,
    pytest_rerun,
)
from harness.report.glance import Glance
from harness.report.markdown_page import (
    capabilities_appendix,
    cost_section,
    fault_section,
    known_failures_section,
    quick_section,
    reshard_appendix,
    throughput_section,
)
from harness.report.sections import SECTIONS, md_link
from harness.report.under_test import under_test


def heading(key: str, level: int = 2) -> list[str]:
    return ["", f"{'#' * level} {SECTIONS[key]}", ""]


def table(header: list[str], rows: list[list[str]], numeric_from: int = 99) -> list[str]:
    align = ["--:" if i >= numeric_from else "---" for i in range(len(header))]
    return ["| " + " | ".join(cells) + " |" for cells in (header, align, *rows)]


def first_screen(g: Glance) -> list[str]:
    """The verdict, what each suite showed, why (counted, the first reasons in full) and what to rerun."""
    md = [
        f"# weightsync certification: {g.label}",
        "",
        f"**{g.label}** (exit status {g.exit_status}): {g.why}",
    ]
    md += ["", *(f"- {line}" for line in g.shown)]
    if g.reasons:
        more = f" (the first {len(g.reasons)}; all: {md_link('why')})" if g.more_reasons else ""
        md += ["", f"Why{more}:", ""]
        md += [f"- **{kind}** {text}" for kind, text in g.reasons]
    if g.reruns:
        more = f" (the first {len(g.reruns)}; all: {md_link('reruns')})" if g.more_reruns else ""
        md += ["", f"Rerun each failure alone, from the repository root{more}:", "", "```"]
        md += [*g.reruns, "```"]
    if g.next_steps:
        md += ["", "Next:", ""]
        md += [f"- {what}: `{command}`" for what, command in g.next_steps]
    return md


def _run_lines(data: dict, env: dict) -> list[str]:
    return [
        "",
        f"- command: `{data['command']}`",
        f"- {jobs_text(data.get('jobs', 1))}",
        f"- generated: {data['generated_at']} on `{env['host']}` ({env['platform']}, {env['cpus']} CPUs, "
        f"torch {env['torch']}, CUDA {'yes' if env['cuda'] else 'no'})",
        "- exit status: 0 PASS, 1 FAIL, 3 COULD NOT DECIDE; "
        "a fraction never hides what its denominator holds (`ok 4/5, 1 NOT_SUPPORTED`)",
        "- sections: "
        + " · ".join(md_link(k) for k in ("under_test", "invariants", "faults", "counts", "throughput")),
    ]


def _full_lists(data: dict, g: Glance) -> list[str]:
    md = []
    if g.more_reasons:
        md += heading("why")
        md += [f"- **failed** {r}" for r in data["reasons"]["failed"]]
        md += [f"- **could not decide** {r}" for r in data["reasons"]["undecided"]]
    if g.more_reruns:
        md += heading("reruns") + ["From the repository root:", ""]
        for r in data["reruns"]:
            md += [f"- {r['suite']} {r['what']}:", f"  `{r['command']}`"]
    return md


def under_test_section(results: dict, faults: dict) -> list[str]:
    rows = [
        [t.backend, ", ".join(t.suites), f"`{t.engine}`", t.receivers, t.profile, t.claims]
        for t in under_test(results, faults)
    ]
    md = heading("under_test")
    md += table(["backend", "suites", "engine", "receivers", "hypothesis profile", "claims"], rows)
    md += [
        "",
        f"claims: the capabilities each backend declares set to yes; every one: {md_link('capabilities')}.",
    ]
    return md


def invariants_section(results: dict) -> list[str]:
    backends = list(results)
    mat = matrix(results)
    md = heading("invariants")
    md += table(
        ["invariant", *backends], [[inv, *(cell(mat[inv].get(b)) for b in backends)] for inv in sorted(mat)]
    )
    md += [
        "",
        "A row's leading numbers are the invariants of docs/architecture.md it checks "
        '("1+3": invariants 1 and 3): '
        + "; ".join(f"{n} {what}" for n, what in INVARIANT_NUMBERS.items())
        + ". A cell: PASS or **FAIL** as a fraction of the row's tests, then what else the fraction holds "
        "(NOT_SUPPORTED: the backend does not claim what the test needs).",
    ]
    return md


def failures_section(data: dict) -> list[str]:
    results = data["conformance"]
    failures = [
        (b, n, rec)
        for b, res in results.items()
        for n, rec in res.get("tests", {}).items()
        if rec.get("status") in ("failed", "error")
    ]
    stopped = [(b, res["error"]) for b, res in results.items() if res.get("error")]
    if not failures and not stopped:
        return []
    md = heading("failures")
    md += [f"- **{b}**: {err}" for b, err in stopped]
    for b, n, rec in failures:
        rerun = pytest_rerun(
            n,
            b,
            data["engine"],
            data["receivers"],
            data["seeds"]["hypothesis_profile"],
            device=results[b].get("device", "cpu"),
        )
        md += [f"### {b}: `{n}`", "", f"rerun: `{rerun}`", "", "```", rec.get("message", "")[-1500:]]
        md += ["```", ""]
    return md


def counts_section(results: dict, faults: dict) -> list[str]:
    md = heading("counts")
    md += table(COUNT_HEADER, count_rows(suite_counts(results, faults)), numeric_from=2)
    md += [
        "",
        "Every suite per backend. conformance: tests; faults: fault cells (passed = ok). failed counts "
        "errors and XPASS too; unknown, a test that could not run; NOT_SUPPORTED, a test of a capability "
        "the backend does not claim; skipped, what --quick left out; known failures, the xfails file's.",
    ]
    return md


def render_markdown(data: dict, rows: list, out_dir: Path, g: Glance) -> str:
    """report.md for results.json's `data` (rows: the SyncRows it came from; plots drawn into out_dir)."""
    results, faults = data["conformance"], data["faults"]
    md = first_screen(g)
    md += _run_lines(data, data["environment"])
    md += _full_lists(data, g)
    md += quick_section(data)
    md += under_test_section(results, faults)
    md += invariants_section(results)
    md += failures_section(data)
    md += known_failures_section(results, faults)
    md += fault_section(faults)
    md += counts_section(results, faults)
    if rows or data.get("throughput_note"):
        md += heading("throughput")
        md += [f"**{data['throughput_note']}**", ""] if data.get("throughput_note") else []
    if rows:
        md += throughput_section(rows, out_dir)[3:]  # its heading is above, with the engine it measured
        md += cost_section(rows)
    md += capabilities_appendix(results, faults)
    md += reshard_appendix(results)
    md.append("")
    return "\n".join(md)
