"""The control suites take the server under test (--weightsync-control-server, harness/control/under_test.py):
they must fail a control server that publishes the new version's label before the commit and keeps it
when the commit is refused, and pass the harness's own server started the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]
CATCHER = "test_a_refused_finish_leaves_weight_info_on_the_old_version_and_label"


def run_control_suite(tmp_path: Path, factory: str) -> dict[str, dict]:
    """suites/control/test_lifecycle.py against servers `factory` starts; each test's record."""
    results = tmp_path / "results.json"
    cmd = [
        sys.executable, "-m", "pytest", "suites/control/test_lifecycle.py", "-q", "-p", "no:cacheprovider",
        "-p", "no:randomly", f"--weightsync-control-server={factory}", f"--weightsync-results={results}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert results.exists(), (
        f"no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    )
    tests = json.loads(results.read_text())["tests"]
    return {node.rsplit("::", 1)[-1]: rec for node, rec in tests.items()}


def test_the_control_suite_fails_a_server_that_publishes_the_label_before_the_commit(tmp_path):
    tests = run_control_suite(tmp_path, "suites.meta.broken_control:start_publishes_before_commit")
    caught = tests[CATCHER]
    assert caught["status"] == "failed", f"{CATCHER}: {caught}"
    assert "the refused version's label was published although nothing committed" in caught["message"], caught
    assert "{'weight_version': '3'}" in caught["message"], caught["message"][-600:]
    # a commit failed inside the engine needs the reference server's engine: not a pass, not a fail
    inside = tests["test_a_commit_that_fails_in_the_engine_leaves_weight_info_on_the_old_label"]
    assert inside["status"] == "not_supported", inside


def test_the_control_suite_passes_the_reference_server_started_by_a_factory(tmp_path):
    tests = run_control_suite(tmp_path, "suites.meta.broken_control:start_reference")
    statuses = {name: rec["status"] for name, rec in tests.items()}
    failed = {name: tests[name].get("message", "")[-600:] for name, s in statuses.items() if s == "failed"}
    assert not failed, failed
    assert statuses[CATCHER] == "passed", statuses
    passed = sum(s == "passed" for s in statuses.values())
    assert passed >= 6, f"only {passed} ran against the factory's server: {statuses}"
