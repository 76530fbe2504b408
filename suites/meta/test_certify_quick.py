"""`weightsync certify --quick` and `--jobs N`: a first look names what it left out and how to run the rest,
and a suite run on pytest-xdist workers decides the same tests, with the same records, as one run serially.

Under xdist the workers run the tests and the controller writes the results file (--weightsync-results) from
the reports they send: every part of a record (NOT_SUPPORTED, hypothesis examples, an xfail's reason, a
failure's message, what a test added to its own record) must come through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]

RECORDS_TEST = """
import pytest
from hypothesis import given, strategies as st

from harness.pytest_plugin import NOT_SUPPORTED, outcomes_of


def test_passes():
    pass


def test_fails():
    assert 1 == 2, "the message the report keeps"


def test_not_supported():
    pytest.skip(f"{NOT_SUPPORTED}: backend 'disk' does not claim ['ipc']")


def test_known_failure():
    assert False, "still broken upstream"


@given(st.integers())
def test_counts_examples(weightsync_example_counter, x):
    weightsync_example_counter()


def test_adds_to_its_record(request):
    outcomes_of(request.config).setdefault(request.node.nodeid, {})["fault_cell"] = {"verdict": "ok", "seed": 7}


@pytest.mark.not_quick
def test_left_out_by_quick():
    pass
"""


def _records(tmp_path: Path, *args: str) -> dict:
    (tmp_path / "test_records.py").write_text(textwrap.dedent(RECORDS_TEST))
    (tmp_path / "xfails.txt").write_text("test_records.py::test_known_failure  # broken upstream\n")
    results = tmp_path / f"results{'-'.join(args)}.json"
    cmd = [sys.executable, "-m", "pytest", "test_records.py", "-q", "-p", "no:cacheprovider"]
    cmd += ["--weightsync-backend=disk", f"--weightsync-results={results}", "--weightsync-quick"]
    cmd += ["--weightsync-xfails-file=xfails.txt", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 1, f"exit {proc.returncode} (one test fails by design):\n{proc.stdout[-3000:]}"
    return json.loads(results.read_text())


def test_xdist_results_keep_every_record_of_a_serial_run(tmp_path):
    serial, parallel = _records(tmp_path), _records(tmp_path, "-n", "2")
    assert parallel["complete"] and "running" not in parallel, parallel
    tests = parallel["tests"]
    assert set(tests) == set(serial["tests"]), (sorted(tests), sorted(serial["tests"]))
    for nodeid, rec in serial["tests"].items():
        mine = {k: v for k, v in tests[nodeid].items() if k not in ("duration_s", "examples", "message")}
        theirs = {k: v for k, v in rec.items() if k not in ("duration_s", "examples", "message")}
        assert mine == theirs, f"{nodeid}: under xdist {tests[nodeid]}, serially {rec}"
    assert tests["test_records.py::test_not_supported"]["status"] == "not_supported", tests
    assert tests["test_records.py::test_known_failure"] == {
        **tests["test_records.py::test_known_failure"],
        "status": "xfailed",
        "reason": "known failure: broken upstream",
    }, tests
    assert "the message the report keeps" in tests["test_records.py::test_fails"]["message"], tests
    assert tests["test_records.py::test_counts_examples"].get("examples", 0) >= 1, tests
    assert tests["test_records.py::test_adds_to_its_record"]["fault_cell"] == {"verdict": "ok", "seed": 7}
    assert parallel["quick_skipped"] == serial["quick_skipped"] == ["test_records.py::test_left_out_by_quick"]


def _certify(tmp_path: Path, jobs: str) -> tuple[int, dict, str]:
    out = tmp_path / f"jobs{jobs}"
    cmd = [sys.executable, "-m", "harness.cli", "certify", "--quick", "--backend", "ipc", "--no-bench"]
    cmd += ["--no-faults", "--jobs", jobs, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    (bundle,) = out.iterdir()
    return (
        proc.returncode,
        json.loads((bundle / "results.json").read_text()),
        (bundle / "report.md").read_text(),
    )


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """certify --quick of the ipc path's conformance suite, one test at a time and on 2 xdist workers."""
    tmp = tmp_path_factory.mktemp("quick")
    return {jobs: _certify(tmp, jobs) for jobs in ("1", "2")}


def test_quick_names_what_it_left_out_and_the_full_run(quick_runs):
    status, data, md = quick_runs["1"]
    assert status == 0 and data["verdict"] == "PASS", data["reasons"]
    assert data["verdict_label"] == "PASS (quick)" and md.startswith(
        "# weightsync certification: PASS (quick)"
    )
    left = data["quick"]["skipped"]["conformance"]["ipc"]
    assert any("test_lifecycle_state_machine" in n for n in left), left
    assert not set(left) & set(data["conformance"]["ipc"]["tests"]), "a test both run and left out"
    assert data["quick"]["total"] == len(left) > 0, data["quick"]
    full = "weightsync certify --backend ipc --no-bench --no-faults --jobs 1 --out "
    assert data["quick"]["full_command"].startswith(full), data["quick"]
    assert "## Skipped by --quick" in md and data["quick"]["full_command"] in md, md[:3000]
    assert f"| ipc | {len(left)} | 0 |" in md, md[:3000]


def test_jobs_2_decides_the_same_tests_as_jobs_1(quick_runs):
    (s1, one, _), (s2, two, md) = quick_runs["1"], quick_runs["2"]
    assert s1 == s2 == 0, (one["reasons"], two["reasons"])
    assert one["jobs"] == 1 and two["jobs"] == 2 and "--jobs 2" in md, (one["jobs"], two["jobs"])
    first, second = one["conformance"]["ipc"]["tests"], two["conformance"]["ipc"]["tests"]
    assert set(first) == set(second), sorted(set(first) ^ set(second))
    differ = {
        n: (first[n]["status"], second[n]["status"])
        for n in first
        if first[n]["status"] != second[n]["status"]
    }
    assert not differ, differ
    assert one["quick"]["skipped"] == two["quick"]["skipped"]


@pytest.mark.parametrize(("cores", "jobs"), [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (128, 8)])
def test_jobs_auto_uses_xdist_only_from_4_cores(monkeypatch, cores, jobs):
    from harness import cli

    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert cli.default_jobs() == jobs, f"{cores} cores: {cli.default_jobs()} workers, expected {jobs}"


def test_the_full_run_is_the_quick_command_less_quick():
    from harness.cli import full_run_command

    argv = ["certify", "--quick", "--backend", "ipc", "--resume", "reports/certify-x", "-j", "4"]
    assert full_run_command(argv) == "weightsync certify --backend ipc -j 4"


def test_a_suite_run_in_two_parts_reads_as_one():
    from harness.suite_runs import merged_parts

    parallel = {
        "complete": True,
        "exitstatus": 0,
        "tests": {"a": {"status": "passed"}},
        "quick_skipped": ["q"],
    }
    serial = {"complete": True, "exitstatus": 5, "tests": {}, "quick_skipped": ["p", "q"]}
    one = merged_parts([parallel, serial])
    assert one["exitstatus"] == 0 and one["complete"] and one["quick_skipped"] == ["p", "q"], one
    failed = {"complete": True, "exitstatus": 1, "tests": {"b": {"status": "failed"}}}
    assert merged_parts([parallel, failed])["exitstatus"] == 1
    stopped = {
        "complete": False,
        "exitstatus": 3,
        "running": "b",
        "in_flight": ["b"],
        "error": "stopped",
        "tests": {},
    }
    two = merged_parts([parallel, stopped])
    assert (
        not two["complete"] and two["exitstatus"] == 3 and two["error"] == "stopped" and two["running"] == "b"
    )


def test_a_run_of_several_backends_splits_into_each_backends_own():
    """certify runs every backend's suite in one interpreter; the report reads one results dict per backend,
    as a run of that backend alone writes it."""
    from harness.suite_runs import split_by_backend

    run = {
        "complete": True,
        "exitstatus": 1,
        "receivers": {"delta": [2], "delta-ipc": [2], "broadcast": [2]},
        "capabilities": {"delta": {"ipc": False}, "delta-ipc": {"ipc": True}, "broadcast": {}},
        "tests": {
            "t.py::a[delta-2rx]": {"status": "passed", "backend": "delta"},
            "t.py::a[delta-ipc-2rx]": {"status": "failed", "backend": "delta-ipc"},
            "t.py::launcher": {"status": "passed"},  # no backend of its own: the broadcast column's
        },
        "quick_skipped": ["t.py::b[delta-ipc-3rx]", "t.py::b[delta-3rx]"],
        "quick_skipped_backends": {"t.py::b[delta-ipc-3rx]": "delta-ipc", "t.py::b[delta-3rx]": "delta"},
    }
    split = split_by_backend(run, ["delta", "delta-ipc", "broadcast"])
    assert {b: sorted(d["tests"]) for b, d in split.items()} == {
        "delta": ["t.py::a[delta-2rx]"],
        "delta-ipc": ["t.py::a[delta-ipc-2rx]"],
        "broadcast": ["t.py::launcher"],
    }, split
    assert {b: d["exitstatus"] for b, d in split.items()} == {"delta": 0, "delta-ipc": 1, "broadcast": 0}
    assert split["delta"]["quick_skipped"] == ["t.py::b[delta-3rx]"], split["delta"]
    assert split["delta-ipc"]["capabilities"] == {"delta-ipc": {"ipc": True}}, split["delta-ipc"]
    assert all(d["backend"] == b and d["complete"] for b, d in split.items())
    stopped = {
        **run,
        "complete": False,
        "exitstatus": 3,
        "error": "stopped",
        "in_flight": ["t.py::a[delta-2rx]"],
    }
    halves = split_by_backend(stopped, ["delta", "delta-ipc", "broadcast"])
    assert halves["delta"]["running"] == "t.py::a[delta-2rx]" and "running" not in halves["delta-ipc"], halves
    assert all(d["error"] == "stopped" and not d["complete"] for d in halves.values()), halves


def test_no_fault_cell_is_marked_serial():
    """certify runs the fault matrix beside the conformance suite and has no serial part for it: a fault test
    that times something against a bound (marked serial) would be judged under that load."""
    cmd = [sys.executable, "-m", "pytest", "suites/faults", "--collect-only", "-q", "-m", "serial"]
    cmd += ["-p", "no:cacheprovider", "--weightsync-backend=disk"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 5, f"tests in suites/faults are marked serial:\n{proc.stdout[-2000:]}"
