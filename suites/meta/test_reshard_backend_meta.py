"""Meta tests: the suites run on the reshard backend (`--weightsync-backend=reshard`, harness/backends/
reshard.py) must fail a planner that cuts one transfer's slice off by one row, and a sender deaf to a
dropped trainer rank (it waits on the rank for good); the reference backend passes the same selections. Each
on the data plane the backend chooses on the host (gloo) and on the ipc plane (engine ranks read the
trainer ranks' shards out of /dev/shm: the GPU variant's plane, its CUDA IPC handles aside)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.reshard.plan import PLANNER_ENV
from harness.reshard.sync import PLANE_ENV
from suites.meta.warm_pytest import runpytest_warm

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.meta, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]
OFF_BY_ONE = "suites.meta.broken_reshard:off_by_one_row_planner"
DEAF = "suites.meta.broken_reshard_backend:make_deaf_backend"


def _run(
    pytester,
    monkeypatch,
    suite: str,
    backend: str,
    select: str,
    planner: str | None = None,
    plane: str = "auto",
):
    """`suite` on `backend` (3 trainer ranks -> TP 2) over `plane`, the tests `select` names, in a subprocess."""
    monkeypatch.setenv(PLANE_ENV, plane)
    if planner:
        monkeypatch.setenv(PLANNER_ENV, planner)
    else:
        monkeypatch.delenv(PLANNER_ENV, raising=False)
    # this checkout's harness, fixtures and suites, whatever else is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return runpytest_warm(
        pytester,
        str(ROOT / "suites" / suite),
        "-p",
        "no:cacheprovider",
        f"--weightsync-backend={backend}",
        "--weightsync-trainer-ranks=3",
        "--weightsync-tp=2",
        "-k",
        select,
    )


@pytest.mark.parametrize("plane", ["auto", "ipc"])
@pytest.mark.parametrize("planner", [OFF_BY_ONE, None], ids=["off-by-one-row", "reference"])
def test_model_updates_fail_a_planner_off_by_one_row_and_pass_the_reference(
    pytester, monkeypatch, planner, plane
):
    """Every engine rank checks its shards against the oracle-cut digests of the manifest before it stages:
    the shifted slice is refused (ManifestMismatch naming the engine rank and the shard), nothing commits."""
    result = _run(
        pytester, monkeypatch, "conformance/test_model_updates.py", "reshard", "full_model", planner, plane
    )
    outcomes = result.parseoutcomes()
    if planner is None:
        assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) >= 1, result.stdout.str()[-3000:]
        return
    assert outcomes.get("failed", 0) >= 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*ManifestMismatch*engine rank*digest*"])


@pytest.mark.parametrize("plane", ["auto", "ipc"])
@pytest.mark.parametrize(
    ("backend", "failed"), [(DEAF, True), ("reshard", False)], ids=["deaf-sender", "reference"]
)
def test_fault_cells_fail_a_sender_deaf_to_a_dropped_trainer_rank(
    pytester, monkeypatch, backend, failed, plane
):
    """A trainer rank SIGKILLed before the transfer: the deaf sender waits on it for good, so the push
    outlives twice the timeout and the next sync cannot run; the reference names the rank and recovers."""
    result = _run(
        pytester,
        monkeypatch,
        "faults/test_fault_matrix.py",
        backend,
        "trainer-rank-kill and before-transfer",
        plane=plane,
    )
    outcomes = result.parseoutcomes()
    if failed:
        assert outcomes.get("failed", 0) == 1, result.stdout.str()[-3000:]
        # (fnmatch reads [...] as a set of characters: the quoted list is matched around)
        result.stdout.fnmatch_lines(["*the error does not say what was damaged (none of *trainer rank*"])
    else:
        assert (outcomes.get("failed", 0), outcomes.get("passed", 0)) == (0, 1), result.stdout.str()[-3000:]
