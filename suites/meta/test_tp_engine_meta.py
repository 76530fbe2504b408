"""Meta tests: the TP engine suite (suites/conformance/test_tp_engine.py) must fail a TP engine whose
ranks skip the all-reduce, and one that commits on rank 0 only (suites/meta/broken_tp.py), in the tests
that check what each breaks, and pass the TP 1 case that cannot tell a missing all-reduce."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from suites.conformance.test_tp_engine import RANK_ENV
from suites.meta.warm_pytest import runpytest_warm

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.meta, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[2]


def _suite(pytester, monkeypatch, rank: str, select: str):
    monkeypatch.setenv(RANK_ENV, rank)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    suite = ROOT / "suites" / "conformance" / "test_tp_engine.py"
    return runpytest_warm(
        pytester, str(suite), "-p", "no:cacheprovider", "-p", "no:randomly", "-rA", "-k", select
    )


def test_a_tp_engine_that_skips_the_all_reduce_fails_the_forward_tests(pytester, monkeypatch):
    result = _suite(pytester, monkeypatch, "suites.meta.broken_tp:NoAllReduceRank", "greedy_tokens")
    outcomes = result.parseoutcomes()
    assert (outcomes.get("failed", 0), outcomes.get("passed", 0)) == (2, 1), result.stdout.str()[-4000:]
    for outcome, m in (("PASSED", 1), ("FAILED", 2), ("FAILED", 3)):  # TP 1 has nothing to reduce
        result.stdout.fnmatch_lines([f"{outcome}*test_greedy_tokens_equal_the_single_process_model?{m}?*"])
    result.stdout.re_match_lines(
        [r".*TP [23]: request greedy-\d+ prompt .*: TP engine tokens .*single-process model.*"]
    )


def test_a_tp_engine_that_commits_on_rank_0_only_fails_the_commit_tests(pytester, monkeypatch):
    select = "a_committed_version or pause_wait or pause_keep or mid_stream"
    result = _suite(pytester, monkeypatch, "suites.meta.broken_tp:LeaderOnlyCommitRank", select)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) == 0 and outcomes.get("failed", 0) == 5, result.stdout.str()[-4000:]
    # the gather refuses rank 1's stale copy of a replicated norm, naming it
    result.stdout.re_match_lines(
        [r".*ManifestMismatch: model\.\S*norm\.weight: engine rank 1's replica differs.*"]
    )
