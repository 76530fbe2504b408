"""Meta tests: the fault suite, run against broken paths, must fail them (and say why)."""

from __future__ import annotations

import time

import pytest

from suites.meta.warm_pytest import runpytest_warm

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.meta  # the suites run against broken implementations: a tier of its own


def _run(pytester, backend: str, kind: str, *args):
    return runpytest_warm(
        pytester,
        "--pyargs",
        "suites.faults",
        "-p",
        "no:cacheprovider",
        f"--weightsync-backend=suites.meta.broken:{backend}",
        "-k",
        kind,
        *args,
    )


def _assert_failed(result, failed: int, lines: list[str]) -> None:
    """`failed` fault cells failed (else the run's tail is shown) and the output says why: `lines`, in order."""
    assert result.parseoutcomes().get("failed", 0) == failed, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(lines)


def test_fault_suite_fails_a_commit_that_lands_on_some_engines_only(pytester):
    result = _run(pytester, "make_partial_commit_backend", "commit-fail-last-engine")
    _assert_failed(result, 1, ["*reported success while engines serve versions*"])


def test_fault_suite_fails_a_supervisor_that_never_restarts(pytester):
    result = _run(pytester, "make_no_restart_backend", "receiver-kill-before-transfer")
    _assert_failed(result, 1, ["*no recovery*"])


def test_fault_suite_fails_a_timeout_that_is_not_honoured(pytester):
    # the named points run deterministically: a stall during finish waits for the rank inside a call
    result = _run(pytester, "make_ignored_timeout_backend", "receiver-stall-during-finish")
    _assert_failed(result, 1, ["*over 2x the 4s timeout*"])


def test_fault_suite_fails_a_control_client_that_does_not_retry_a_cut_request(pytester):
    result = _run(
        pytester,
        "make_no_retry_control_backend",
        "fault_cell and update_weights and (http-request-cut or http-answer-lost)",
    )
    _assert_failed(result, 2, ["*a fault the client must ride out*"])


def test_fault_suite_fails_a_delta_that_keeps_its_base_after_a_split(pytester):
    # consecutive versions make v2 and v3 patches; after one engine committed v2 and one did not, a
    # patch against v1 is refused by the engine at v2: only a full sync converges them
    result = _run(pytester, "make_base_keeping_delta_backend", "commit-fail-last-engine")
    _assert_failed(result, 1, ["*no recovery*patch made against version 1, engine holds version 2*"])


def test_fault_suite_fails_a_writer_that_publishes_before_the_last_shard(pytester):
    # the named points kill the trainer at fixed reads; one lands while the shards are written
    result = _run(pytester, "make_publish_first_disk_backend", "trainer-kill")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*trainer-kill-mid-move*", "*a partial version 2 is visible*"])


def test_fault_suite_fails_an_ipc_sender_that_keys_its_segments_by_descriptor_only(pytester):
    # segments removed from /dev/shm between syncs: the sender packs into files no receiver can open
    result = _run(
        pytester, "make_descriptor_keyed_ipc_backend", "fault_cell and (shm-removed or shm-replaced)"
    )
    _assert_failed(
        result, 2, ["*x shm-removed*", "*no recovery*does not exist in /dev/shm: removed by another process*"]
    )


def test_fault_suite_fails_a_disk_sender_that_assumes_its_last_checkpoint_exists(pytester):
    result = _run(
        pytester, "make_last_checkpoint_trusting_disk_backend", "fault_cell and checkpoints-removed"
    )
    _assert_failed(result, 1, ["*x checkpoints-removed*", "*no recovery*No such file or directory*"])


def test_fault_suite_fails_a_declared_half_hour_timeout_before_anything_runs(pytester):
    t0 = time.monotonic()
    result = _run(pytester, "make_declared_half_hour_backend", "fault_cell and receiver-stall")
    elapsed = time.monotonic() - t0
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 3 and not outcomes.get("passed"), result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*bounded: the backend declares rank rpc = 1800 s*"])
    assert elapsed < 60, f"failing by declaration took {elapsed:.0f} s: something ran"


def test_fault_suite_bounds_an_undeclared_half_hour_wait_by_its_own_deadline(pytester):
    t0 = time.monotonic()
    result = _run(pytester, "make_undeclared_half_hour_backend", "receiver-stall-during-finish")
    elapsed = time.monotonic() - t0
    _assert_failed(
        result,
        1,
        ["*phase 'push' overran its * s budget*rank * in 'finish_weight_update'*", "*cell's stack*"],
    )
    assert elapsed < 120, f"the overrun was caught after {elapsed:.0f} s (the backend waits 1800 s)"


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
    # hypothesis names the failing draw "Falsifying example"; 6.170.27 (CI installs the newest) "Failing test case"
    result.stdout.re_match_lines([r".*(Falsifying example|Failing test case).*", r".*seed=.*"])
