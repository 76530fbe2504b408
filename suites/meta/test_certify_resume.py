"""`weightsync certify --resume BUNDLE`: a certify run stopped by a job's time limit is finished in a second
run that reuses what the first one finished (whole suites, throughput rows) and runs only what is missing;
a bundle begun with other arguments is refused, since its evidence would not answer the same question."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.bench import SyncRow
from harness.cli import finished_suite, main

pytestmark = pytest.mark.meta

NODE = "suites/conformance/test_bitwise.py::test_dtypes_arrive_bit_for_bit[disk-2]"
FAULT_NODE = "suites/faults/test_fault_matrix.py::test_fault_cell[disk-kill_at_byte]"
ARGS = ["certify", "--backend", "disk", "--sizes-mib", "1", "--repeats", "1"]


def _began(tmp_path, *extra: str) -> str:
    """A bundle as a first run leaves it when stopped after its suites: main() writes certify-args.json and
    then runs the conformance suite, so the test begins it with a usage error after the folder is made."""
    out = tmp_path / "certify-first"
    out.mkdir()
    args = {
        "backend": ["disk"],
        "engine": "reference",
        "receivers": "auto",
        "profile": "ci",
        "sizes_mib": [1],
        "repeats": 1,
        "no_bench": False,
        "floor": [],
        "no_faults": False,
        "xfails_file": None,
        "device": "cpu",
    }
    first = "weightsync " + " ".join(ARGS[0:1] + list(extra) + ARGS[1:])
    (out / "certify-args.json").write_text(json.dumps({"args": args, "commands": [first]}))
    return str(out)


def _suite(status: str, complete: bool = True) -> dict:
    tests = {NODE: {"status": status, "message": "expected 1.0, got 2.0"}}
    return {"backend": "disk", "engine": "reference", "complete": complete, "exitstatus": 0, "tests": tests}


def _faults() -> dict:
    cell = {"fault": "kill_at_byte", "backend": "disk", "seed": 7, "point": "rx0 byte 100", "verdict": "ok"}
    cell |= {"reasons": [], "detect_s": 0.5, "recover_s": 0.2, "timeout_s": 4.0}
    return {
        "complete": True,
        "exitstatus": 0,
        "tests": {FAULT_NODE: {"status": "passed", "fault_cell": cell}},
    }


def _row() -> dict:
    return SyncRow("disk", 1, 1 << 20, 8, "bf16", 0.01, 0.1, 0.2, 0, floor=0.1).to_json()


def test_resume_reuses_finished_suites_and_rows_and_runs_nothing_again(tmp_path):
    bundle = _began(tmp_path)
    (tmp_path / "certify-first" / "conformance-disk.json").write_text(json.dumps(_suite("failed")))
    (tmp_path / "certify-first" / "faults-disk.json").write_text(json.dumps(_faults()))
    (tmp_path / "certify-first" / "throughput-disk.json").write_text(json.dumps([_row()]))
    status = main([*ARGS, "--resume", bundle])
    data = json.loads((tmp_path / "certify-first" / "results.json").read_text())
    ran = sorted(p.name for p in (tmp_path / "certify-first").glob("pytest-*.log"))
    assert ran == [], f"--resume ran suites the first run had finished: {ran}"
    assert (status, data["verdict"]) == (1, "FAIL"), (
        f"the reused conformance failure must decide the verdict: exit {status}, {data['verdict']}, "
        f"reasons {data['reasons']}"
    )
    assert data["conformance"]["disk"]["tests"][NODE]["status"] == "failed"
    assert data["faults"]["disk"]["tests"][FAULT_NODE]["fault_cell"]["verdict"] == "ok"
    assert [r["size_bytes"] for r in data["throughput"]] == [1 << 20], data["throughput"]
    assert data["command"].count("weightsync certify") == 2 and "--resume" in data["command"], (
        f"the report must name both runs that made it: {data['command']!r}"
    )


def test_a_suite_the_first_run_was_stopped_in_is_not_reused(tmp_path):
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "conformance-disk.json").write_text(json.dumps(_suite("passed", complete=False)))
    (bundle / "faults-disk.json").write_text(json.dumps(_faults()))
    assert finished_suite(bundle, "conformance", "disk") is None, (
        "a stopped suite's partial results were reused"
    )
    assert finished_suite(bundle, "faults", "disk")["tests"], "a finished suite was not reused"
    assert finished_suite(bundle, "faults", "ipc") is None


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["--backend", "ipc"], "backend"),
        (["--no-faults"], "no_faults"),
        (["--sizes-mib", "64"], "sizes_mib"),
        (["--profile", "thorough"], "profile"),
    ],
)
def test_resume_with_other_arguments_is_a_usage_error_that_names_them(tmp_path, capsys, extra, names):
    bundle = _began(tmp_path)
    args = [*ARGS, *extra] if extra[0] != "--backend" else ["certify", *extra, *ARGS[3:]]
    before = sorted(p.name for p in (tmp_path / "certify-first").iterdir())
    assert main([*args, "--resume", bundle]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the terminal's line breaks
    assert f"{names}:" in err and "asked differently" in err, err[-1500:]
    after = sorted(p.name for p in (tmp_path / "certify-first").iterdir())
    assert after == before, f"a refused --resume changed the bundle: {before} -> {after}"


def test_resume_of_a_folder_that_is_no_bundle_names_it(tmp_path, capsys):
    assert main([*ARGS, "--resume", str(tmp_path)]) == 2
    err = "".join(capsys.readouterr().err.split())
    assert "notacertifybundle" in err and str(tmp_path) in err, err[-1500:]


def test_certify_stopped_by_sigterm_stops_its_suite_and_leaves_it_to_resume(tmp_path):
    """What --resume stands on: `timeout` (a job's limit) sends certify SIGTERM; certify stops its running
    suite the same way (the plugin records where it was) and exits 143 within STOP_BOUND_S, leaving no
    process it started, printing the line that finishes the bundle; that suite is not counted finished."""
    from harness.procs import pid_alive
    from harness.stopping import STOP_BOUND_S, descendants

    cmd = [sys.executable, "-m", "harness.cli", "certify", "--backend", "disk", "--no-faults", "--no-bench"]
    proc = subprocess.Popen(
        [*cmd, "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started: list[int] = []
    try:
        # the conformance run of every backend at once (split per backend when it ends)
        results = lambda: next(tmp_path.glob("certify-*/conformance-run-parallel.json"), None)  # noqa: E731
        deadline = time.monotonic() + 120
        while results() is None:  # the plugin writes it after the first test: the suite is under way
            assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
            assert time.monotonic() < deadline, "the conformance suite wrote no results in 120 s"
            time.sleep(0.2)
        started = descendants(proc.pid)  # pytest, and the ranks of the test it is in
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for pid in [proc.pid, *started]:  # what the test started, should the stop have left any
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    text = out.decode()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, text[-2000:])
    assert took < STOP_BOUND_S, f"certify took {took:.1f} s to stop (bound {STOP_BOUND_S} s):\n{text[-2000:]}"
    left = [pid for pid in started if pid_alive(pid)]
    assert not left, f"processes certify started outlived it: {_describe(left)}"
    assert "--resume" in text and "finish it with" in text, text[-2000:]
    data = json.loads(results().read_text())
    assert not data["complete"], "the stopped suite's results say complete"
    assert finished_suite(results().parent, "conformance", "disk") is None, (
        "the stopped suite's per-backend results were written as finished"
    )


def _describe(pids: list[int]) -> list[str]:
    """'pid (state, pgid): command' of each process, for a failure message."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
        out.append(f"{pid} ({stat[0]}, pgid {stat[2]}, ppid {stat[1]}): {cmd}")
    return out
