"""Meta tests: the conformance suite, run by pytest against broken implementations, must fail."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def _run(pytester, *args):
    return pytester.runpytest_subprocess("--pyargs", "suites.conformance", "-p", "no:cacheprovider", *args)


def test_suite_fails_a_path_that_loses_the_sign_of_zero(pytester):
    result = _run(pytester, "--weightsync-backend=suites.meta.broken:make_sign_losing_backend",
                  "--weightsync-receivers=1", "-k", "special_values")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 3, f"expected bf16/fp16/fp32 failures, got {outcomes}"
    result.stdout.fnmatch_lines(["*not bitwise equal*"])


def test_suite_fails_an_engine_that_keeps_a_stale_prefix_cache(pytester):
    result = _run(pytester, "--weightsync-backend=disk", "--weightsync-receivers=1",
                  "--weightsync-engine=suites.meta.broken:make_stale_cache_engine", "-k", "fresh_engine")
    assert result.parseoutcomes().get("failed", 0) == 1, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines(["*prefix cache not invalidated*"])


def test_unknown_backend_is_a_usage_error_not_a_crash(pytester):
    result = _run(pytester, "--weightsync-backend=nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stderr.str()
    result.stderr.fnmatch_lines(["ERROR: unknown backend 'nope'*"])


def test_report_header_names_what_is_under_test(pytester):
    result = _run(pytester, "--weightsync-backend=disk", "--weightsync-receivers=1", "-k", "special_values and F32")
    result.stdout.fnmatch_lines(["weightsync: backend=disk*", "weightsync:   capabilities=*", "weightsync: engine=*"])
    assert result.ret == 0, result.stdout.str()[-2000:]
