"""The throughput gate must catch a path that got slower while staying correct: the ratio gate fails it in
the same run, and pytest-benchmark's --benchmark-compare against a saved run of the healthy path flags it."""

from __future__ import annotations

import json

import pytest

from harness.pytest_plugin import UNKNOWN
from suites.meta.warm_pytest import runpytest_warm

pytest_plugins = ["pytester"]

SLOW = "suites.meta.broken:make_needless_copy_broadcast_backend"
FLOOR = 0.25  # healthy broadcast at 64 MiB on 2 cores: 0.42-0.65
pytestmark = [pytest.mark.multiproc, pytest.mark.meta, pytest.mark.serial]  # throughput rows: alone


def _run(pytester, backend, *args):
    return runpytest_warm(
        pytester,
        "--pyargs",
        "suites.performance.test_sync_throughput",
        "-p",
        "no:cacheprovider",
        "-k",
        "against",
        f"--weightsync-backend={backend}",
        "--weightsync-bench-mib=64",
        f"--weightsync-floor=broadcast={FLOOR}",
        "-rs",  # a row missed on a busy host is skipped as UNKNOWN: its reason in the output
        *args,
    )


def test_a_slower_build_of_a_path_fails_the_ratio_gate_and_the_benchmark_compare(pytester, tmp_path):
    storage = f"file://{tmp_path / 'benchmarks'}"
    healthy = _run(
        pytester,
        "broadcast",
        f"--benchmark-storage={storage}",
        "--benchmark-save=healthy",
        f"--benchmark-json={tmp_path / 'healthy.json'}",
    )
    healthy.assert_outcomes(passed=1)
    slow = _run(
        pytester,
        SLOW,
        f"--benchmark-storage={storage}",
        "--benchmark-compare",
        "--benchmark-compare-fail=median:50%",
        f"--benchmark-json={tmp_path / 'slow.json'}",
    )
    out = slow.stdout.str() + slow.stderr.str()
    assert slow.ret != 0, out[-3000:]
    assert "Performance has regressed" in out, out[-3000:]
    # The row's verdict from the JSON: a compare that fails raises inside pytest's terminal summary,
    # before the short summary (-rs) could print a skip's reason.
    before, after = (
        json.loads((tmp_path / f"{n}.json").read_text())["benchmarks"][0] for n in ("healthy", "slow")
    )
    if after["extra_info"]["verdict"] == "host busy":  # the floor is not judged on a busy host
        pytest.skip(
            f"{UNKNOWN}: the slow build was measured while other jobs took "
            f"{after['extra_info']['other_cores']:.1f} CPUs; the compare caught it"
        )
    assert "below the floor in 2 of 2 attempts: attempt 1: broadcast 1 rx 64 MiB" in out, (
        f"{json.dumps(after['extra_info'])}\n{out[-3000:]}"
    )
    assert before["name"] == after["name"] == "test_sync_throughput_against_its_ceiling[broadcast]"
    assert after["extra_info"]["ratio"] < before["extra_info"]["ratio"] / 2, (
        before["extra_info"],
        after["extra_info"],
    )
