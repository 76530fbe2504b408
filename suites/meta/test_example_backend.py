"""The out-of-tree backend of README's walk-through (examples/backend, `toy_sync`) passes a conformance
file when named the way an outside author names it: an import path, from its own package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.meta  # the suites run against another implementation: a tier of its own

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "backend"


def test_example_backend_passes_the_bitwise_suite(tmp_path):
    results = tmp_path / "results.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "suites/conformance/test_bitwise.py",
        "--weightsync-backend=toy_sync:make_backend",
        "--weightsync-receivers=2",
        f"--weightsync-results={results}",
        "-p",
        "no:randomly",
        "-q",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    rerun = f"PYTHONPATH={EXAMPLE} {' '.join(command[2:])}"
    assert proc.returncode == 0, (
        f"exit {proc.returncode}, expected 0; rerun: {rerun}\n{proc.stdout[-3000:]}{proc.stderr[-1500:]}"
    )
    tests = json.loads(results.read_text())["tests"]
    not_passed = {name: t["status"] for name, t in tests.items() if t["status"] != "passed"}
    assert tests and not not_passed, (
        f"expected every test passed, got {not_passed or 'no tests'}; rerun: {rerun}"
    )
