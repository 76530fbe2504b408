"""The suites' memory is bounded (issue 40, item 6): a session kept every deployment it built alive to its end
(82 rank processes, about 150 MB each, on a 23 GiB machine the kernel's OOM killer ended the default tier).
Now the deployment pool keeps at most MAX_LIVE_DEPLOYMENTS alive, the least recently used closed first, and
the tests of one (backend, receiver count) run together, so each deployment is built about once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.launch.supervision import live_rank_count
from harness.procs import pid_alive
from harness.pytest_plugin import MAX_LIVE_DEPLOYMENTS, DeploymentPool, Selection
from harness.registry import engine_path, resolve_backend

pytestmark = [pytest.mark.meta, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]


def _rank_pids(deployment) -> list[int]:
    return [rank.pid for rank in deployment.processes()]


def test_the_pool_closes_the_least_recently_used_deployment(tmp_path):
    engine = engine_path("reference")
    sel = Selection({"disk": resolve_backend("disk")}, engine, engine, "auto")
    pool = DeploymentPool(sel, tmp_path, max_live=2)
    before = live_rank_count()
    try:
        one, two = pool.get("disk", 1), pool.get("disk", 2)
        assert pool.get("disk", 1) is one, "a live deployment was built again"
        first_ranks = _rank_pids(two)
        assert first_ranks, "the deployment names no rank process: the test would show nothing"
        three = pool.get("disk", 3)  # two is now the least recently used: closed
        assert not any(pid_alive(p) for p in first_ranks), (
            f"the evicted deployment's ranks {first_ranks} are still alive"
        )
        assert live_rank_count() - before == 1 + 3, (
            f"{live_rank_count() - before} rank processes alive for deployments of 1 and 3 receivers"
        )
        assert pool.get("disk", 2) is not two and pool.built == 4, (
            "an evicted deployment was not built again when asked for"
        )
        assert pool.get("disk", 3) is three
    finally:
        pool.close()
    assert live_rank_count() == before, "the pool left rank processes alive after close()"


def test_a_suite_run_holds_at_most_the_pools_bound_of_rank_processes(tmp_path):
    """Two conformance files on every built-in CPU path at 2 and 3 receivers (10 targets): with every
    deployment kept, 25 rank processes were alive at once; the bound is MAX_LIVE_DEPLOYMENTS deployments of
    at most 3 receivers, plus those a test makes for itself."""
    results = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "suites/conformance/test_bitwise.py",
        "suites/conformance/test_patch.py",
    ]
    cmd += ["-q", "-p", "no:cacheprovider", f"--weightsync-results={results}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    peak = json.loads(results.read_text())["peak_live_ranks"]
    bound = MAX_LIVE_DEPLOYMENTS * 3 + 3
    assert 0 < peak <= bound, f"{peak} rank processes alive at once; the bound is {bound}"
    assert f"at most {peak} rank processes" in proc.stdout, proc.stdout[-1500:]
