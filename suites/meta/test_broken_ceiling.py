"""A broken ceiling must never let a row pass. The bug this models happened here (2026-12-02): the gloo
ceiling cut the payload into small messages where the path sends large ones, so the "ceiling" ran slower
than the path it bounds. A ceiling slower than its path gives a ratio above 1.0: the row is
`unreliable`, the pytest gate does not pass it, and a certification with it is FAIL (docs/performance.md)."""

from __future__ import annotations

import pytest

from harness import bench, ceilings
from harness.backends.broadcast import BroadcastBackend
from harness.report import FAIL, decide

pytestmark = [pytest.mark.multiproc, pytest.mark.meta, pytest.mark.serial]  # throughput rows: alone

SIZE = 16 << 20
PIECE = 4 << 10  # the broken ceiling's message size: 4,096 messages where the path sends a few


def _cut_into_small_messages(backend, weights, receivers, workdir, bucket_bytes=None):
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return ceilings.CollectiveCeiling([PIECE] * (nbytes // PIECE), receivers, backend="gloo")


def test_a_ceiling_slower_than_its_path_never_passes_the_gate(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "make_ceiling", _cut_into_small_messages)
    with bench.SyncBench(
        BroadcastBackend(), SIZE, 1, str(tmp_path), gate=bench.Gate(0.25, 0.08, "test"), repeats=3
    ) as measure:
        for _ in range(3):
            args, kwargs = measure.before()
            measure.push(*args, **kwargs)
        row = measure.row()
    figures = f"path {row.time_s * 1e3:.1f} ms, best ceiling {min(row.ceiling_times_s) * 1e3:.1f} ms"
    assert row.wrong == 0, figures
    assert row.ratio > 1.0, (
        f"the broken ceiling was not slower than the path ({figures}): the test shows nothing"
    )
    assert (row.verdict, row.passed) == ("unreliable", False), (row.verdict, row.passed, figures)
    assert bench.gate_failures([row]) == [f"broadcast 1rx {SIZE}: unreliable"]
    decision = decide({}, rows=[row])
    assert decision.verdict == FAIL and "unreliable" in decision.failed[0], decision

    from suites.performance.test_sync_throughput import _gate

    class Benchmark:  # the pytest-benchmark fixture's part the gate uses
        extra_info: dict = {}

    with pytest.raises(pytest.skip.Exception, match="UNRELIABLE"):
        _gate([row], Benchmark())
