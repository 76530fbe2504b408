"""Soak: 1000 consecutive syncs (trainer steps: a patch path sends patches) with a fault every 20th, on
every built-in path (or those selected), each fault judged like a matrix cell. The faults rotate through
those that apply to the path: during a push, and damage between syncs (segments removed or replaced,
checkpoints deleted, a rank killed idle, the group's port taken). RSS growth, leaked resources and
every verdict written as JSON. Marker `soak` (and `slow`): outside the default tier.

    pytest suites/faults/test_soak.py -m soak --weightsync-backend=broadcast,ipc,delta,disk -s
    WEIGHTSYNC_SOAK_SYNCS=200 pytest suites/faults/test_soak.py -m soak          # a shorter soak
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.faults.soak import run_soak, soak_backends

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.multiproc]


@pytest.mark.parametrize("backend_name", soak_backends())
def test_soak_with_a_fault_every_20_syncs(backend_name, weightsync_selection, tmp_path, request):
    if backend_name not in weightsync_selection.backends:
        pytest.skip(f"{backend_name} is not selected (--weightsync-backend)")
    syncs = int(os.environ.get("WEIGHTSYNC_SOAK_SYNCS", "1000"))
    report = run_soak(
        weightsync_selection.backends[backend_name],
        backend_name,
        tmp_path,
        syncs=syncs,
        fault_every=20,
        engine=weightsync_selection.engine,
        caps=weightsync_selection.capabilities(backend_name),
    )
    out = Path(request.config.getoption("--weightsync-soak-out") or tmp_path) / f"soak-{backend_name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nsoak {backend_name}: {report['summary']} -> {out}")
    bad = [c for c in report["cells"] if c["verdict"] not in ("ok", "not_applicable")]
    assert not bad, f"soak {backend_name}: {len(bad)} fault(s) not ok: " + "; ".join(
        f"sync {c['sync']} {c['fault']}: {c['verdict']} {c['reasons']}" for c in bad[:5]
    )
    assert not report["leaks"], f"soak {backend_name}: leaked {report['leaks']}"
    # after every fault path ran once the allocators are warm: from there on nothing may grow with syncs
    assert report["steady_rss_growth_mib"] < 64, f"soak {backend_name}: {report['summary']}"
    assert report["steady_fds_growth"] <= 4 and report["steady_threads_growth"] <= 4, (
        f"soak {backend_name}: {report['summary']}"
    )
