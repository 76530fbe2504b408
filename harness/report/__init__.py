"""The certification bundle: results.json a machine reads (docs/results-schema.md), junit.xml for CI, and
report.md / report.html a person reads; and the one verdict that both the report and the exit status carry.

The verdict weighs every piece of evidence (Jepsen's rule: unknown is never ok):
FAIL if anything showed a failure (a test, a fault cell, a throughput row with #wrong > 0 or below its
floor); else COULD NOT DECIDE if any evidence is missing (a suite crashed, was killed or wrote no results,
a cell is unknown, the throughput could not be measured, or nothing at all was shown); else PASS.

The package's rooms, from the bottom: `counts` (what each suite showed, counted), `sections` (the sections'
titles and anchors, one table both pages read), `evidence` (the verdict, its reasons, rerun lines, the
environment), `under_test` (the backends and their capabilities), `glance` (the first screen: verdict, why,
what to rerun), `plots`, `markdown_page` + `markdown_report` and `html_parts` + `html_sections` +
`html_page` (the two pages a person reads), `bundle` (the folder: results.json, junit.xml, report.md,
report.html, reshard-plan.md). What callers use is importable from here.
"""

from __future__ import annotations

from harness.report.bundle import (
    merge_junit,
    write_report,
)
from harness.report.evidence import (
    EXIT_STATUS,
    FAIL,
    INVARIANTS,
    PASS,
    SCHEMA_VERSION,
    UNDECIDED,
    Decision,
    bench_rerun,
    between_syncs_kinds,
    cell,
    damage_of,
    decide,
    environment,
    fault_cell_text,
    fault_matrix,
    invariant_of,
    known_failures,
    matrix,
    pytest_rerun,
    quick_skipped,
    reruns,
    verdict_label,
)
from harness.report.html_page import render
from harness.report.markdown_page import (
    breakdown_table,
    fault_section,
    known_failures_section,
    quick_section,
    throughput_section,
    throughput_table,
)
from harness.report.plots import (
    plot_breakdown,
    plot_throughput,
)

__all__ = [
    "INVARIANTS",
    "SCHEMA_VERSION",
    "PASS",
    "FAIL",
    "UNDECIDED",
    "EXIT_STATUS",
    "environment",
    "Decision",
    "known_failures",
    "decide",
    "pytest_rerun",
    "bench_rerun",
    "reruns",
    "quick_skipped",
    "verdict_label",
    "invariant_of",
    "matrix",
    "cell",
    "fault_matrix",
    "between_syncs_kinds",
    "damage_of",
    "fault_cell_text",
    "plot_throughput",
    "plot_breakdown",
    "known_failures_section",
    "quick_section",
    "fault_section",
    "throughput_table",
    "throughput_section",
    "breakdown_table",
    "merge_junit",
    "write_report",
    "render",
]
