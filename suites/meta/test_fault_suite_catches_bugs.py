"""Meta tests: the fault suite, run against broken paths, must fail them (and say why)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.meta  # the suites run against broken implementations: a tier of its own


def _run(pytester, backend: str, kind: str, *args):
    return pytester.runpytest_subprocess(
        "--pyargs",
        "suites.faults",
        "-p",
        "no:cacheprovider",
        f"--weightsync-backend=suites.meta.broken:{backend}",
        "-k",
        kind,
        *args,
    )


def test_fault_suite_fails_a_commit_that_lands_on_some_engines_only(pytester):
    result = _run(pytester, "make_partial_commit_backend", "commit-fail")
    assert result.parseoutcomes().get("failed", 0) == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*reported success while engines serve versions*"])


def test_fault_suite_fails_a_supervisor_that_never_restarts(pytester):
    result = _run(pytester, "make_no_restart_backend", "receiver-kill")
    assert result.parseoutcomes().get("failed", 0) == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*no recovery*"])


def test_fault_suite_fails_a_timeout_that_is_not_honoured(pytester):
    # the stall lands at a seeded point; over two seeds at least one lands inside a call
    result = _run(pytester, "make_ignored_timeout_backend", "receiver-stall", "--weightsync-fault-seeds=2")
    assert result.parseoutcomes().get("failed", 0) >= 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*over 2x the 4s timeout*"])


def test_fault_suite_fails_a_control_client_that_does_not_retry_a_cut_request(pytester):
    result = _run(
        pytester, "make_no_retry_control_backend", "fault_cell and (http-request-cut or http-answer-lost)"
    )
    assert result.parseoutcomes().get("failed", 0) == 2, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*a fault the client must ride out*"])


@pytest.mark.slow  # the thorough tier's own check: the default tier runs one seed per cell
def test_thorough_profile_draws_seeds_and_prints_the_failing_one(pytester):
    result = _run(
        pytester,
        "make_no_retry_control_backend",
        "drawn and http-answer-lost",
        "--weightsync-hypothesis-profile=thorough",
        "--weightsync-fault-seeds=2",
    )
    assert result.parseoutcomes().get("failed", 0) == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*Falsifying example*", "*seed=*"])
