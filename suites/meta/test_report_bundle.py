"""The certify verdict and its bundle, on synthetic results (seconds, nothing runs): every kind of evidence
can flip PASS to FAIL, missing evidence is COULD NOT DECIDE (never PASS), and the bundle carries the verdict,
the rerun lines, a merged junit.xml and a self-contained report.html."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from harness.bench import SyncRow
from harness.report import EXIT_STATUS, SCHEMA_VERSION, decide, write_report

pytestmark = pytest.mark.meta

NODE = "suites/conformance/test_bitwise.py::test_dtypes_arrive_bit_for_bit[disk-2]"
FAULT_NODE = "suites/faults/test_fault_matrix.py::test_fault_cell[disk-kill_at_byte]"


def _suite(*statuses: str, **extra) -> dict:
    tests = {
        f"{NODE[:-8]}{i}]": {"status": s, "message": "expected 1.0, got 2.0"} for i, s in enumerate(statuses)
    }
    return {"backend": "disk", "engine": "x:y", "complete": True, "exitstatus": 0, "tests": tests, **extra}


def _row(wrong: int = 0, ratio: float = 0.8, floor: float = 0.6) -> SyncRow:
    """A row whose verified ceiling is `ratio` of its time: at 0.6 and up it is within what `floor` allows."""
    return SyncRow(
        "disk", 1, 64 << 20, 8, "bf16", 0.1, ratio, 1.0, wrong, floor=floor, verified_times_s=[0.1 * ratio]
    )


def _fault_run(verdict: str, status: str) -> dict:
    cell = {
        "fault": "kill_at_byte",
        "backend": "disk",
        "seed": 7,
        "point": "rx0 byte 100",
        "verdict": verdict,
    }
    cell |= {"reasons": ["v2 half applied"], "detect_s": 0.5, "recover_s": 0.2, "timeout_s": 4.0}
    return {"complete": True, "exitstatus": 0, "tests": {FAULT_NODE: {"status": status, "fault_cell": cell}}}


def test_all_evidence_good_is_pass_and_exit_0():
    d = decide({"disk": _suite("passed", "not_supported")}, {"disk": _fault_run("ok", "passed")}, [_row()])
    assert (d.verdict, d.exit_status, d.failed, d.undecided) == ("PASS", 0, [], [])


@pytest.mark.parametrize(
    ("results", "faults", "rows", "names"),
    [
        ({"disk": _suite("passed", "failed")}, {}, [], "test_dtypes"),
        ({"disk": _suite("passed")}, {"disk": _fault_run("fail", "failed")}, [], "kill_at_byte"),
        ({"disk": _suite("passed")}, {}, [_row(wrong=3)], "wrong"),
        ({"disk": _suite("passed")}, {}, [_row(ratio=0.3)], "below floor"),
        ({"disk": _suite("passed", exitstatus=1)}, {}, [], "exited 1"),
    ],
    ids=["conformance-test", "fault-cell", "row-wrong", "row-below-floor", "teardown-error"],
)
def test_each_kind_of_evidence_flips_pass_to_fail(results, faults, rows, names):
    d = decide(results, faults, rows)
    assert d.verdict == "FAIL" and d.exit_status == 1, f"{d}"
    assert any(names in r for r in d.failed), f"no reason names {names!r}: {d.failed}"


@pytest.mark.parametrize(
    ("results", "faults", "missing", "names"),
    [
        (
            {"disk": {"exitstatus": -9, "tests": {}, "error": "pytest produced no results (exit -9)"}},
            {},
            (),
            "no results",
        ),
        ({"disk": _suite("passed", complete=False, running=NODE)}, {}, (), "stopped during"),
        ({"disk": _suite("passed", exitstatus=2)}, {}, (), "exited 2"),
        ({"disk": _suite("not_supported", "skipped")}, {}, (), "nothing was shown"),
        ({"disk": _suite("passed")}, {"disk": _fault_run("unknown", "unknown")}, (), "unknown"),
        ({"disk": _suite("passed")}, {}, ["throughput disk: not measured (OSError: full)"], "not measured"),
        ({}, {}, (), "nothing was run"),
    ],
    ids=["crashed", "killed", "interrupted", "all-not-supported", "unknown-cell", "bench-raised", "empty"],
)
def test_missing_evidence_is_could_not_decide_and_exit_3(results, faults, missing, names):
    d = decide(results, faults, [], missing)
    assert d.verdict == "COULD NOT DECIDE" and d.exit_status == 3, f"{d}"
    assert any(names in r for r in d.undecided), f"no reason names {names!r}: {d.undecided}"


def test_a_failure_outweighs_missing_evidence():
    d = decide({"disk": _suite("failed", complete=False)}, {}, [])
    assert d.verdict == "FAIL" and d.undecided, f"{d}"


def _junit(path, tests, failures):
    failure = "<failure message='x'/>"
    cases = "".join(
        f'<testcase classname="c" name="t{i}">{failure if i < failures else ""}</testcase>'
        for i in range(tests)
    )
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" '
        f'errors="0" skipped="0" time="1.5">{cases}</testsuite></testsuites>'
    )


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A FAIL bundle: one failed conformance test, one failed fault cell, one row with #wrong > 0
    (written once: the plots take seconds)."""
    tmp_path = tmp_path_factory.mktemp("certify-bundle")
    _junit(tmp_path / "junit-conformance-disk.xml", 3, 1)
    _junit(tmp_path / "junit-faults-disk.xml", 2, 1)
    rows = [_row(), SyncRow("disk", 2, 1 << 20, 8, "bf16", 0.01, 0.1, 0.5, 2)]
    write_report(
        tmp_path,
        {"disk": _suite("passed", "failed", "not_supported")},
        rows,
        "weightsync certify --backend disk --engine reference",
        {"disk": _fault_run("fail", "failed")},
        engine="reference",
        receivers="auto",
        repeats=2,
        throughput_engine="reference",
        throughput_note="throughput measured with the engine under test, reference",
    )
    return tmp_path


def test_results_json_carries_the_schema_version_and_the_one_verdict(bundle):
    data = json.loads((bundle / "results.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert (data["verdict"], data["exit_status"]) == ("FAIL", EXIT_STATUS["FAIL"])
    assert data["throughput_engine"] == "reference" and data["run_id"] == bundle.name
    assert data["seeds"]["fault_seeds"] == [7]
    md = (bundle / "report.md").read_text()
    assert md.startswith("# weightsync certification: FAIL"), md[:200]


def test_every_failure_has_a_rerun_line_in_json_and_markdown(bundle):
    data = json.loads((bundle / "results.json").read_text())
    commands = [r["command"] for r in data["reruns"]]
    conf = f"python -m pytest '{NODE[:-8]}1]' --weightsync-backend=disk --weightsync-engine=reference"
    assert any(c.startswith(conf) and c.endswith("--weightsync-receivers=auto") for c in commands), commands
    assert any(FAULT_NODE in c and "--weightsync-fault-seed=7" in c for c in commands), commands
    bench = "weightsync bench --backend disk --sizes-mib 1 --receivers 2 --repeats 2"
    assert bench in commands, commands
    assert len(commands) == 3, f"only failures get a rerun line: {commands}"
    md = (bundle / "report.md").read_text()
    for c in commands:
        assert c in md, f"{c!r} not in report.md"


def test_junit_xml_merges_every_suite_with_its_counts(bundle):
    root = ET.parse(bundle / "junit.xml").getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"conformance-disk", "faults-disk"}, set(suites)
    assert (root.get("tests"), root.get("failures")) == ("5", "2"), root.attrib
    assert len(list(root.iter("testcase"))) == 5


def test_report_html_is_self_contained_and_shows_verdict_matrix_command(bundle):
    page = (bundle / "report.html").read_text()
    for needle in (
        "FAIL",
        "Invariants × paths",
        "1 bitwise (dtypes, shapes, NaN, -0.0)",
        "Fault matrix",
        "weightsync certify --backend disk --engine reference",
        "--weightsync-fault-seed=7",
        "throughput measured with the engine under test, reference",
        "Environment",
        "hypothesis profile",
    ):
        assert needle in page, f"{needle!r} not in report.html"
    external = re.findall(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page) + re.findall(r"@import", page)
    assert not external, f"report.html loads external resources: {external}"
    assert 'src="data:image/png;base64,' in page, "the throughput plot is not embedded"


def test_the_three_renderers_show_the_same_throughput_cells(bundle):
    """The terminal, report.md and report.html tables have the columns and the cells of
    bench.throughput_cells, for rows of every verdict, gated (floor) or not."""
    import html

    from harness.bench import THROUGHPUT_COLUMNS, throughput_cells
    from harness.cli import throughput_table as terminal_table
    from harness.report import throughput_table as markdown_table
    from harness.report.html_page import render

    rows = [
        _row(),  # ok
        _row(ratio=0.3),  # below floor
        _row(ratio=1.2),  # unreliable
        _row(wrong=2),  # wrong
        SyncRow("disk", 1, 64 << 20, 8, "bf16", 0.1, 0.8, 0.0, 0, floor=0.6),  # no ceiling
        _row(floor=0.0),  # not gated: ok
        _row(ratio=1.2, floor=0.0),  # not gated: unreliable
        _row(wrong=1, floor=0.0),  # not gated: wrong
    ]
    assert {r.verdict for r in rows} == {"ok", "below floor", "unreliable", "wrong", "no ceiling"}
    expected = [list(THROUGHPUT_COLUMNS)] + [throughput_cells(r) for r in rows]
    assert [cells[-1] for cells in expected[1:]] == [r.verdict for r in rows]

    table = terminal_table(rows, "note")
    terminal = [[str(c.header) for c in table.columns]] + [
        list(cells) for cells in zip(*(list(c.cells) for c in table.columns), strict=True)
    ]
    lines = markdown_table(rows)
    markdown = [[c.strip() for c in line.strip("|").split("|")] for line in [lines[0], *lines[2:]]]
    data = json.loads((bundle / "results.json").read_text())
    page = render(data, rows, bundle)
    body = page[page.index('<h2 id="sync-throughput">Sync throughput</h2>') :]
    body = body[body.index("<table>") : body.index("</table>")]
    page_rows = re.findall(r"<tr>(.*?)</tr>", body)
    in_html = [[html.unescape(c) for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", tr)] for tr in page_rows]

    assert terminal == expected, terminal
    assert markdown == expected, markdown
    assert in_html == expected, in_html


def test_rerun_lines_carry_the_profile_the_seed_and_the_delta_fraction():
    from harness.report import bench_rerun, pytest_rerun

    line = pytest_rerun(NODE, "disk", "vllm", "1", profile="thorough", seed=3)
    assert line == (
        f"python -m pytest '{NODE}' --weightsync-backend=disk --weightsync-engine=vllm "
        "--weightsync-receivers=1 --weightsync-fault-seed=3 --weightsync-hypothesis-profile=thorough"
    ), line
    row = SyncRow(
        "delta", 2, 64 << 20, 8, "bf16", 0.1, 0.05, 1.0, 0, floor=0.12, changed=0.01, floor_source="--floor"
    )
    assert bench_rerun(row, repeats=5) == (
        "weightsync bench --backend delta --sizes-mib 64 --receivers 2 --repeats 5 "
        "--delta-fractions 0.01 --floor delta=0.12"
    )


def test_rerun_lines_name_the_device_and_the_factory_a_run_was_given():
    """A certify on a GPU with an adapter: its rerun lines run on that GPU, and name the backend as it was
    given (pkg.module:factory), not its display name, which `--backend` cannot resolve."""
    from harness.report import reruns

    suite = _suite("failed", device="cuda:0")
    row = SyncRow(
        "checkpoint-engine", 1, 64 << 20, 8, "bf16", 0.5, 0.1, 1400.0, 0, floor=0.5, device="cuda:0",
        verified_times_s=[0.01],
    )  # fmt: skip
    row.backend = "weightsync_checkpoint_engine:make_backend"
    conformance, throughput = (r["command"] for r in reruns({"disk": suite}, {}, [row], "reference", "1"))
    assert conformance.endswith("--weightsync-device=cuda:0"), conformance
    assert throughput.startswith("weightsync bench --backend weightsync_checkpoint_engine:make_backend "), (
        throughput
    )
    assert throughput.endswith("--device cuda:0"), throughput


def test_a_row_is_remeasured_with_the_engine_that_measured_it():
    from harness.report import reruns

    lines = reruns({"disk": _suite("failed")}, {}, [_row(wrong=1)], "vllm", "1", bench_engine="reference")
    conformance, throughput = (r["command"] for r in lines)
    assert "--weightsync-engine=vllm" in conformance, conformance
    assert throughput.startswith("weightsync bench --backend disk") and "--engine" not in throughput, (
        throughput
    )


def test_damage_between_syncs_gets_rows_of_its_own_with_what_was_damaged(tmp_path):
    cells = {
        "receiver-kill": {"family": "in-push", "verdict": "ok"},
        "shm-removed": {"family": "between-syncs", "verdict": "fail"},
    }
    tests = {
        f"{FAULT_NODE[:-2]}-{kind}]": {
            "status": "passed" if c["verdict"] == "ok" else "failed",
            "fault_cell": {
                **c,
                "fault": kind,
                "backend": "ipc",
                "seed": 1,
                "point": kind,
                "reasons": ["no recovery"] if c["verdict"] == "fail" else [],
                "detect_s": 0.1,
                "recover_s": 0.2,
                "timeout_s": 4.0,
            },
        }
        for kind, c in cells.items()
    }
    faults = {"ipc": {"complete": True, "exitstatus": 1, "tests": tests}}
    write_report(tmp_path, {"ipc": _suite("passed")}, [], "weightsync certify --backend ipc", faults)
    md = (tmp_path / "report.md").read_text()
    in_push, between = md.split("### Damage between syncs")
    assert "| receiver-kill |" in in_push and "| shm-removed |" not in in_push, md
    assert "| shm-removed | Every shared-memory segment of the trainer unlinked from /dev/shm" in between, md
    assert "**FAIL** 1/1" in between, md
    page = (tmp_path / "report.html").read_text()
    assert "Damage between syncs" in page and "unlinked from /dev/shm" in page


def test_known_failures_are_listed_with_their_reason_and_an_xpass_fails(tmp_path):
    """certify --xfails-file: a strict xfail is a known failure (listed, the verdict unharmed); an XPASS, a
    listed failure that no longer fails, fails the verdict."""
    suite = _suite("passed", "xfailed")
    suite["tests"][f"{NODE[:-8]}1]"]["reason"] = "known failure: finding 7: scalars"
    write_report(tmp_path, {"disk": suite}, [], "weightsync certify --backend disk --xfails-file x.txt", {})
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["verdict"] == "PASS", data["reasons"]
    md = (tmp_path / "report.md").read_text()
    assert "## Known failures" in md and "| finding 7: scalars |" in md, md
    assert "finding 7: scalars" in (tmp_path / "report.html").read_text()
    assert decide({"disk": _suite("passed", "xpassed")}, {}, []).verdict == "FAIL"
