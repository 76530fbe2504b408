"""A report read at a glance (issue 40, item 5), on hand-made evidence (suites/meta/report_samples.py; seconds,
nothing runs): the first screen says the verdict, why (counted) and what to rerun; no fraction hides a
NOT_SUPPORTED point; every suite is counted per backend; the control column is under test; every row label
is defined where it appears; every floor shows its source and its reason; the long sections sit in an
appendix or a file of their own, and every link of both pages resolves."""

from __future__ import annotations

import html
import json
import re

import pytest

from harness.report.evidence import INVARIANT_NUMBERS, INVARIANTS
from harness.report.sections import RESHARD_FILE, slug
from suites.meta.report_samples import write_sample

pytestmark = pytest.mark.meta

#: The lines of report.md a person reads before scrolling.
FIRST_SCREEN_LINES = 25


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    out = tmp_path_factory.mktemp("glance-fail")
    write_sample(out, failing=True)
    return out


@pytest.fixture(scope="module")
def passing(tmp_path_factory):
    out = tmp_path_factory.mktemp("glance-pass")
    write_sample(out, failing=False)
    return out


def pages(bundle) -> tuple[str, str, dict]:
    md = (bundle / "report.md").read_text()
    page = (bundle / "report.html").read_text()
    return md, page, json.loads((bundle / "results.json").read_text())


def html_first_screen(page: str) -> str:
    """What report.html shows above its first section: everything before the first <h2>."""
    return html.unescape(page[: page.index("<h2")])


def test_the_first_screen_says_fail_why_counted_and_what_to_rerun(failing):
    md, page, data = pages(failing)
    top = "\n".join(md.splitlines()[:FIRST_SCREEN_LINES])
    failed = len(data["reasons"]["failed"])
    assert failed > 5, f"the sample must fail more than the first screen lists: {data['reasons']}"
    assert top.startswith("# weightsync certification: FAIL"), top
    assert (
        f"{failed} failed (conformance disk 3, conformance ipc 2, faults disk 1, faults control 1, throughput 1)"
        in top
    ), top
    assert "Why (the first 5; all: [Why, in full](#why-in-full))" in top, top
    assert (
        "Rerun each failure alone, from the repository root (the first 5; all: [Rerun each failure alone]"
        in top
    )
    shown = [r["command"] for r in data["reruns"]][:5]
    assert all(c in top for c in shown), f"the first 5 rerun commands must be on the first screen:\n{top}"
    first = html_first_screen(page)
    assert "FAIL" in first and "exit status 1" in first and "conformance disk 3" in first, first
    assert all(c in first for c in shown), first
    for key in ("failed", "undecided"):  # every reason and rerun is somewhere on both pages
        assert all(r in md and html.escape(r) in page for r in data["reasons"][key])
    assert all(r["command"] in md and html.escape(r["command"]) in page for r in data["reruns"])


def test_the_first_screen_of_a_pass_says_what_it_rests_on_and_what_to_run_next(passing):
    md, page, data = pages(passing)
    assert data["verdict"] == "PASS", data["reasons"]
    top = "\n".join(md.splitlines()[:FIRST_SCREEN_LINES])
    assert "**PASS** (exit status 0): nothing failed and nothing was left undecided" in top, top
    assert "- conformance: 7 tests on 2 backend(s): 5 passed, 2 NOT_SUPPORTED" in top, top
    assert "- faults: 16 fault cells on 2 backend(s): 12 ok, 4 NOT_SUPPORTED" in top, top
    assert "- throughput: 1 row(s) on 1 path(s): 1 within their floors" in top, top
    assert f"this run again: `{data['command']}`" in top, top
    first = html_first_screen(page)
    assert "PASS" in first and "nothing failed" in first and data["command"] in first, first


@pytest.mark.parametrize("bundle", ["failing", "passing"])
def test_no_fraction_hides_a_not_supported_point(bundle, request):
    md, page, _ = pages(request.getfixturevalue(bundle))
    for text in (md, html.unescape(page)):
        fractions = re.findall(r"\b(?:ok|PASS|FAIL\*{0,2}|unknown) \d+/\d+[^|<]*", text)
        assert fractions, text[:2000]
        for f in fractions:
            done, total = map(int, re.search(r"(\d+)/(\d+)", f).groups())
            if done != total and "FAIL" not in f:
                assert "NOT_SUPPORTED" in f or "skipped" in f, f"{f!r} hides what its denominator holds"
    assert "ok 4/5, 1 NOT_SUPPORTED (0.5s / 0.2s)" in md, md


def test_every_suite_is_counted_per_backend_and_control_is_under_test(failing):
    md, page, _ = pages(failing)
    counts = md[md.index("## Counts") :].split("\n\n")[1]
    for suite, backend in (
        ("conformance", "disk"),
        ("conformance", "ipc"),
        ("faults", "disk"),
        ("faults", "control"),
    ):
        assert f"| {suite} | {backend} |" in counts, counts
    under = md[md.index("## What was under test") :].split("\n\n")[1]
    assert "| control | faults |" in under, under
    assert "<td>control</td><td>faults</td>" in page


def test_every_row_label_is_defined_where_it_appears(failing):
    md, page, _ = pages(failing)
    numbers = {
        int(n)
        for name in INVARIANTS.values()
        for n in re.findall(r"^(\d+(?:\+\d+)*) ", name)[:1]
        for n in n.split("+")
    }
    assert numbers <= set(INVARIANT_NUMBERS), (
        f"invariant numbers used but not defined: {numbers - set(INVARIANT_NUMBERS)}"
    )
    invariants = md[md.index("## Invariants × paths") :].split("\n## ")[0]
    for n, what in INVARIANT_NUMBERS.items():
        assert f"{n} {what}" in invariants and f"{n} {html.escape(what)}" in page, f"invariant {n} undefined"
    faults = md[md.index("## Fault matrix") :].split("\n## ")[0]
    for kind in ("receiver-kill", "commit-fail"):
        row = next(line for line in faults.splitlines() if line.startswith(f"| {kind} |"))
        assert len(row.split("|")[2].strip()) > 20, f"{kind}'s row does not say what it injects: {row}"
    plan = (failing / RESHARD_FILE).read_text()
    for col in ("src", "dst", "src_rows", "cols", "dst_rows"):
        assert f"- {col}: " in plan, f"transfer column {col} undefined in {RESHARD_FILE}"


def test_every_floor_shows_its_source_and_its_reason(failing):
    md, page, data = pages(failing)
    floors = md[md.index("### Floors") :].split("\n\n")[1]
    for row in data["throughput"]:
        line = next(x for x in floors.splitlines() if x.startswith(f"- **{row['path']}**"))
        assert f"bandwidth floor {row['floor']:g}" in line and row["floor_source"] in line, line
        assert line.endswith(row["floor_reason"]), line
        assert html.escape(row["floor_reason"]) in page


def test_long_sections_are_in_the_appendix_or_their_own_file_and_every_link_resolves(failing):
    md, page, _ = pages(failing)
    body = md[: md.index("## Appendix")]
    assert "Resharding plan" not in body and "arbitrary_tensors=" not in md, "long sections left in the body"
    assert "model.layers.0.self_attn.q_proj.weight" not in md, "the plan's transfers belong in their own file"
    assert "## Appendix A: capabilities" in md and "## Appendix B: resharding plan" in md
    headings = {slug(h) for h in re.findall(r"^#+ (.+)$", md, re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", md):
        file, _, frag = target.partition("#")
        if file:
            assert (failing / file).exists(), f"report.md links {file}, which is not in the bundle"
        else:
            assert frag in headings, f"report.md links #{frag}, which no heading has: {sorted(headings)}"
    ids = set(re.findall(r'id="([^"]+)"', page))
    for href in re.findall(r'href="([^"]+)"', page):
        if href.startswith("#"):
            assert href[1:] in ids, f"report.html links {href}, which no element has"
        else:
            assert (failing / href).exists(), f"report.html links {href}, which is not in the bundle"
