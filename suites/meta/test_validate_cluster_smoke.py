"""validate-cluster's conformance smoke against a broken rollout rank: rank 2 flips one bit of what the fabric
delivered (--corrupt-rank, the harness's own fault injection). The smoke must FAIL naming that rank, the
tensor and the element, and no other rank; the links themselves are fine (no rating, no peer check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.meta]

ENV = {
    **os.environ,
    "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
}  # the ranks import this checkout's harness


def test_a_rank_that_corrupts_what_it_receives_fails_the_smoke_by_name(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["-m", "harness.cli", "validate-cluster", "--trainer-ranks", "0", "--rollout-ranks", "1-3"]
    cmd += [
        "--sizes-mib",
        "1",
        "--repeats",
        "1",
        "--peer-share",
        "0",
        "--corrupt-rank",
        "2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=ENV)
    report_file = tmp_path / "validate-cluster.json"
    assert report_file.exists(), f"exit {proc.returncode}, no report:\n{(proc.stdout + proc.stderr)[-3000:]}"
    report = json.loads(report_file.read_text())
    reasons = report["reasons"]
    assert proc.returncode != 0 and report["verdict"] == "FAIL", f"{reasons}\n{proc.stdout[-3000:]}"
    assert reasons and all(r.startswith("rank 2 version ") for r in reasons), reasons
    assert reasons[0].startswith("rank 2 version 1: embed.weight not bitwise equal: 1/32768 elements differ; "
                                 "first at flat index 7"), reasons  # fmt: skip
