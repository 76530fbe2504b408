"""Meta tests: the conformance suite, run by pytest against broken implementations, must fail."""

from __future__ import annotations

import json

import pytest

from suites.meta.warm_pytest import runpytest_warm

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.meta  # the suites run against broken implementations: a tier of its own


def _run(pytester, *args):
    return runpytest_warm(pytester, "--pyargs", "suites.conformance", "-p", "no:cacheprovider", *args)


def _assert_failed(result, failed: int, lines: list[str], passed: int | None = None) -> None:
    """`failed` tests failed, and `passed` passed where given (else the run's tail is shown); the output
    says why: `lines`, in order."""
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == failed and (passed is None or outcomes.get("passed", 0) == passed), (
        result.stdout.str()[-2000:]
    )
    result.stdout.fnmatch_lines(lines)


def test_suite_fails_a_path_that_loses_the_sign_of_zero(pytester):
    result = _run(
        pytester,
        "--weightsync-backend=suites.meta.broken:make_sign_losing_backend",
        "--weightsync-receivers=1",
        "-k",
        "special_values",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 3, f"expected bf16/fp16/fp32 failures, got {outcomes}"
    result.stdout.fnmatch_lines(["*not bitwise equal*"])


def test_suite_fails_an_engine_that_keeps_a_stale_prefix_cache(pytester):
    result = _run(
        pytester,
        "--weightsync-backend=disk",
        "--weightsync-receivers=1",
        "--weightsync-engine=suites.meta.broken:make_stale_cache_engine",
        "-k",
        "fresh_engine",
    )
    _assert_failed(result, 1, ["*prefix cache not invalidated*"])


def test_suite_fails_a_path_that_leaks_per_sync(pytester):
    result = _run(pytester, "--weightsync-backend=suites.meta.broken:make_leaky_backend", "-k", "grows")
    _assert_failed(result, 1, ["*these grew*trainer fds*workdir files*"])


def test_unknown_backend_is_a_usage_error_not_a_crash(pytester):
    result = _run(pytester, "--weightsync-backend=nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stderr.str()
    result.stderr.fnmatch_lines(["ERROR: unknown backend 'nope'*"])


def test_report_header_names_what_is_under_test(pytester):
    result = _run(
        pytester, "--weightsync-backend=disk", "--weightsync-receivers=1", "-k", "special_values and F32"
    )
    result.stdout.fnmatch_lines(
        ["weightsync: backend=disk*", "weightsync:   capabilities=*", "weightsync: engine=*"]
    )
    assert result.ret == 0, result.stdout.str()[-2000:]


def test_results_file_survives_a_killed_run_and_names_the_test_it_stopped_in(pytester):
    # A hang killed by a timeout (or a lost GPU machine) must not erase what already passed.
    pytester.makepyfile(
        test_dies="""
        import os, signal

        def test_first_passes():
            pass

        def test_second_is_killed():
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    results = pytester.path / "results.json"
    run = runpytest_warm(
        pytester, "-p", "no:cacheprovider", "--weightsync-backend=disk", f"--weightsync-results={results}"
    )
    assert run.ret != 0, "the killed run reported success"
    data = json.loads(results.read_text())
    assert data["complete"] is False and data["running"].endswith("test_second_is_killed"), (
        f"results of a killed run: complete={data.get('complete')}, running={data.get('running')}"
    )
    statuses = {k.rsplit("::", 1)[-1]: v.get("status") for k, v in data["tests"].items()}
    assert statuses == {"test_first_passes": "passed"}, f"results of a killed run: {statuses}"


def test_suite_fails_a_delta_that_compares_values_not_bits(pytester):
    result = _run(
        pytester,
        "--weightsync-backend=suites.meta.broken:make_value_diff_delta_backend",
        "--weightsync-receivers=1",
        "-k",
        "patch_carries_special_values and signed-zero",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 3, f"expected a failure per float dtype, got {outcomes}"
    assert outcomes.get("passed", 0) == 0, outcomes


def test_suite_fails_a_path_that_cuts_buckets_larger_than_its_unit(pytester):
    """The bucket test bites where the old payloads could not: they never held a tensor larger than a
    bucket, so a sender that copies at most `bucket_bytes` of one passed the bitwise tests."""
    broken = "--weightsync-backend=suites.meta.broken:make_tail_losing_ipc_backend"
    old = _run(pytester, broken, "--weightsync-receivers=1", "-k", "test_many_tensors_across_buckets")
    assert old.parseoutcomes().get("passed", 0) == 1, old.parseoutcomes()
    new = _run(
        pytester, broken, "--weightsync-receivers=1", "-k", "test_payload_spanning_many_buckets and 1000"
    )
    outcomes = new.parseoutcomes()
    assert outcomes.get("failed", 0) == 1, f"expected the unaligned bucket size to fail, got {outcomes}"
    assert "digest" in new.stdout.str(), new.stdout.str()[-2000:]


def _engine_run(pytester, engine, k, *extra):
    return _run(
        pytester,
        "--weightsync-backend=disk",
        "--weightsync-receivers=1",
        f"--weightsync-engine={engine}",
        "-k",
        k,
        *extra,
    )


def test_suite_fails_a_tied_head_that_keeps_the_embedding_it_was_loaded_with(pytester):
    broken = "suites.meta.broken:make_stale_tied_head_engine"
    result = _engine_run(
        pytester, broken, "tied_head or full_model_update", f"--weightsync-tied-engine={broken}"
    )
    outcomes = result.parseoutcomes()
    # read back by name the weights are right; computed, they are not
    assert outcomes.get("failed", 0) == 1 and outcomes.get("passed", 0) >= 1, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines(
        [
            "*_ test_tied_head_computes_with_the_pushed_embedding*",
            "*does not compute like an independent forward*",
        ]
    )


def test_suite_fails_an_engine_that_caches_a_kept_requests_old_kv_after_the_update(pytester):
    result = _engine_run(
        pytester, "suites.meta.broken:make_decode_block_caching_engine", "fresh_engine or under_traffic"
    )
    _assert_failed(
        result,
        1,
        ["*_ test_new_requests_after_an_update_under_traffic*keep*", "*stale KV from version 0 served?*"],
        passed=2,
    )


def test_suite_fails_a_pause_that_misses_queued_requests(pytester):
    # (every other pause test stays within the batch of 8, and passes it)
    result = _engine_run(
        pytester, "suites.meta.broken:make_queue_blind_pause_engine", "queued_behind_the_batch"
    )
    _assert_failed(
        result,
        2,
        [
            "*_ test_pause_reaches_requests_queued_behind_the_batch*abort*",
            "*_ test_pause_reaches_requests_queued_behind_the_batch*wait*",
        ],
        passed=1,
    )


def test_suite_fails_a_kept_request_that_finishes_on_the_old_weights(pytester):
    result = _engine_run(pytester, "suites.meta.broken:make_deferred_swap_engine", "kept_requests_continue")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines(
        [
            "*_ test_kept_requests_continue_as_an_independent_forward*",
            "*the continuation matches instead: old*",
        ]
    )


def test_suite_fails_an_in_place_rollback_that_forgets_fused_slices(pytester):
    result = _engine_run(pytester, "suites.meta.broken:make_fused_blind_rollback_engine", "in_place")
    _assert_failed(
        result,
        1,
        ["*_ test_rollback_restores_the_committed_version*", "*after an in-place load rolled back*"],
        passed=2,
    )


def test_receivers_stream_into_an_engine_that_loads_in_place_on_every_path(pytester):
    """The reference engine that loads in place (receivers write each verified part into the live
    weights, roll back on refusal or abort) passes the bitwise, bad-input and in-place checks on every path."""
    result = _run(
        pytester,
        "--weightsync-engine=reference-in-place",
        "--weightsync-receivers=2",
        "-k",
        "bad_input or full_model_update or in_place",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) >= 30, result.stdout.str()[-3000:]


def test_suite_fails_a_receiver_that_stages_into_the_memory_its_engine_serves(pytester):
    """A staging pool that reuses its last buffer whatever holds it: a refused sync has already written
    into the engine's weights, so 'loses nothing' fails (the real pool checks the buffer's use count)."""
    result = _run(
        pytester,
        "--weightsync-backend=suites.meta.broken:make_one_buffer_ipc_backend",
        "--weightsync-receivers=1",
        "-k",
        "corrupted_digest",
    )
    _assert_failed(result, 1, ["*after forged digest*"])


def test_suite_fails_tokens_stamped_when_read_not_when_made(pytester):
    # every other pause test reads its streams as they are made, and passes it
    result = _engine_run(pytester, "suites.meta.broken:make_read_stamping_engine", "test_pause_resume")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 1 and outcomes.get("passed", 0) >= 5, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines(
        ["*_ test_token_stamps_are_the_generating_version_when_read_late*", "*the stamp is taken when read*"]
    )


def test_a_claimed_deployment_that_fails_is_one_named_failure(pytester):
    result = _run(
        pytester,
        "--weightsync-backend=suites.meta.broken:make_one_receiver_only_backend",
        "-k",
        "deploys_with_what_it_claims or test_bitwise",
        "-rs",
    )
    # it claims 2 and 3 receivers (the default counts of a multi-receiver backend): one failure each,
    # every test that needs those deployments NOT_SUPPORTED at once, no error in any setup
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 2 and not outcomes.get("errors"), result.stdout.str()[-3000:]
    assert outcomes.get("not_supported", 0) >= 4, outcomes
    result.stdout.fnmatch_lines(
        [
            "*test_deploys_with_what_it_claims*2rx*",
            "*deploys with 2 receiver(s)*Address already in use*",
            "*NOT_SUPPORTED*broken:*deploys with 2 receiver(s)*",
        ]
    )
