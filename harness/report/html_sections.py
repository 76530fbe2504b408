"""report.html's first screen and the sections it shares with report.md's order: what was under test, the
counts, the floors, the appendix (capabilities, the resharding plan's bytes per rank)."""

from __future__ import annotations

from harness.report.counts import COUNT_HEADER, count_rows, suite_counts
from harness.report.evidence import (
    INVARIANT_NUMBERS,
    floor_notes,
    reshard_bytes_rows,
    reshard_heading,
    reshard_plans,
)
from harness.report.glance import Glance
from harness.report.html_parts import e, h2, table, verdict_class
from harness.report.sections import RESHARD_FILE, SECTIONS, anchor
from harness.report.under_test import capability_table, under_test

#: The files of the bundle the first screen links to (they are written beside report.html).
BUNDLE_FILES = ("results.json", "junit.xml", "report.md")


def link(key: str, text: str | None = None) -> str:
    return f'<a href="{anchor(key)}">{e(text or SECTIONS[key])}</a>'


def first_screen(g: Glance, data: dict) -> list[str]:
    """The verdict, what each suite showed, why, what to rerun, then the run's particulars and links."""
    parts = [
        "<h1>weightsync certification</h1>",
        '<div class="first">',
        f'<div class="verdict {verdict_class(g.verdict)}">{e(g.label)}</div>',
        f"<p><strong>exit status {g.exit_status}</strong>: {e(g.why)}</p>",
        "<ul>" + "".join(f"<li>{e(line)}</li>" for line in g.shown) + "</ul>",
    ]
    if g.reasons:
        more = f" (the first {len(g.reasons)}; all: {link('why')})" if g.more_reasons else ""
        parts.append(f"<h3>Why{more}</h3><ul>")
        parts += [
            f'<li><span class="{"fail" if kind == "failed" else "unknown"}">{e(kind)}</span> {e(text)}</li>'
            for kind, text in g.reasons
        ]
        parts.append("</ul>")
    if g.reruns:
        more = f" (the first {len(g.reruns)}; all: {link('reruns')})" if g.more_reruns else ""
        parts.append(f"<h3>Rerun each failure alone, from the repository root{more}</h3>")
        parts += [f'<pre class="rerun">{e(c)}</pre>' for c in g.reruns]
    if g.next_steps:
        parts.append("<h3>Next</h3><ul>")
        parts += [f"<li>{e(what)}: <code>{e(cmd)}</code></li>" for what, cmd in g.next_steps]
        parts.append("</ul>")
    parts.append("</div>")
    files = " · ".join(f'<a href="{f}">{f}</a>' for f in BUNDLE_FILES)
    keys = ("under_test", "invariants", "faults", "counts", "throughput", "capabilities")
    parts += [
        f'<p class="meta">run <code>{e(data["run_id"])}</code> · generated {e(data["generated_at"])} · '
        f"exit status 0 PASS, 1 FAIL, 3 COULD NOT DECIDE · this bundle: {files}</p>",
        "<nav>sections: " + "".join(link(k) for k in keys) + "</nav>",
    ]
    return parts


def full_lists(data: dict, g: Glance) -> list[str]:
    """Every reason and every rerun line, where the first screen showed only the first few."""
    parts = []
    if g.more_reasons:
        parts += [h2("why"), "<ul>"]
        parts += [f'<li><span class="fail">failed</span> {e(r)}</li>' for r in data["reasons"]["failed"]]
        parts += [
            f'<li><span class="unknown">could not decide</span> {e(r)}</li>'
            for r in data["reasons"]["undecided"]
        ]
        parts.append("</ul>")
    if g.more_reruns:
        parts += [h2("reruns"), "<p>From the repository root:</p><ul>"]
        parts += [
            f"<li>{e(r['suite'])} {e(r['what'])}<pre>{e(r['command'])}</pre></li>" for r in data["reruns"]
        ]
        parts.append("</ul>")
    return parts


def under_test_parts(results: dict, faults: dict) -> list[str]:
    rows = [
        [t.backend, ", ".join(t.suites), t.engine, t.receivers, t.profile, t.claims]
        for t in under_test(results, faults)
    ]
    return [
        h2("under_test"),
        table(["backend", "suites", "engine", "receivers", "hypothesis profile", "claims"], rows),
        f"<p>claims: the capabilities each backend declares set to yes; every one: {link('capabilities')}.</p>",
    ]


def invariant_legend() -> str:
    items = "; ".join(f"{n} {e(what)}" for n, what in INVARIANT_NUMBERS.items())
    return (
        "<p>A row's leading numbers are the invariants of docs/architecture.md it checks (&quot;1+3&quot;: "
        f"invariants 1 and 3): {items}. A cell: PASS or FAIL as a fraction of the row's tests, then what "
        "else the fraction holds (NOT_SUPPORTED: the backend does not claim what the test needs).</p>"
    )


def counts_parts(results: dict, faults: dict) -> list[str]:
    return [
        h2("counts"),
        table(COUNT_HEADER, count_rows(suite_counts(results, faults)), numeric_from=2),
        "<p>Every suite per backend. conformance: tests; faults: fault cells (passed = ok). failed counts "
        "errors and XPASS too; unknown, a test that could not run; NOT_SUPPORTED, a test of a capability the "
        "backend does not claim; skipped, what --quick left out; known failures, the xfails file's.</p>",
    ]


def floors_parts(rows: list) -> list[str]:
    notes = floor_notes(rows)
    if not notes:
        return []
    items = "".join(f"<li><strong>{e(path)}</strong>: {e(text)}</li>" for path, text in notes)
    return [f'<h3 id="floors">{e(SECTIONS["floors"])}</h3><ul>{items}</ul>']


def appendix_parts(results: dict, faults: dict) -> list[str]:
    """Appendix A, every capability each backend declares; B, the resharding plans' bytes per rank (every
    transfer: RESHARD_FILE)."""
    parts = []
    tested = under_test(results, faults)
    if tested:
        header, rows = capability_table(tested)
        parts += [h2("capabilities"), table(header, rows)]
    plans = reshard_plans(results)
    if plans:
        parts += [
            h2("reshard"),
            "<p>Trainer FSDP2 / DTensor shards → engine tensor-parallel shards (docs/resharding.md). planned = "
            "the bytes the plan moves from or to the rank; minimum = the checkpoint bytes each engine rank's "
            "shards hold (total: their sum); measured = what the sync counted. Every transfer: "
            f'<a href="{RESHARD_FILE}">{RESHARD_FILE}</a>.</p>',
        ]
        for backend, node, plan in plans:
            parts.append(f"<h3><code>{e(node)}</code> ({e(backend)})</h3><p>{e(reshard_heading(plan))}</p>")
            body = [
                [*cells[:4], f'<td class="{"ok" if cells[4] in ("ok", "-") else "fail"}">{e(cells[4])}</td>']
                for cells in reshard_bytes_rows(plan)
            ]
            parts.append(
                table(["rank", "planned B", "minimum B", "measured B", "measured = minimum"], body, 1)
            )
            tied = [
                f"<li>tied: <code>{e(a)}</code> is <code>{e(b)}</code></li>"
                for a, b in plan.get("tied", {}).items()
            ]
            if tied:
                parts += ["<ul>", *tied, "</ul>"]
    return parts
