"""The plugin loads into every pytest run of the environment (a pytest11 entry point): it must leave a run
that selects nothing of weightsync as it found it, and report NOT_SUPPORTED as a status of its own."""

from __future__ import annotations

import json
import re

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.meta

PLAIN = """
from hypothesis import settings

def test_unrelated():
    print(f"PROFILE={settings.get_current_profile_name()} MAX_EXAMPLES={settings.default.max_examples}")
"""
BARE_FIXTURES = (
    "backend",
    "capabilities",
    "n_receivers",
    "deployment_pool",
    "deployment",
    "deployment_with_buckets",
    "tied_deployment",
    "selection",
    "example_counter",
)


def _profile_line(result) -> str:
    lines = [line for line in result.stdout.lines if "PROFILE=" in line]
    assert lines, result.stdout.str()[-2000:]
    return lines[0][lines[0].index("PROFILE=") :]


@pytest.mark.parametrize("ci", ["CI=true", "no CI"])  # hypothesis loads its own "ci" profile when CI is set
def test_a_run_that_selects_nothing_of_weightsync_is_left_as_it_was(pytester, monkeypatch, ci):
    if ci == "no CI":
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", "true")
    pytester.makepyfile(test_plain=PLAIN)
    loaded = pytester.runpytest_subprocess("-s", "-p", "no:randomly", "-p", "no:cacheprovider")
    without = pytester.runpytest_subprocess(
        "-s", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:weightsync"
    )
    assert loaded.ret == 0, loaded.stdout.str()[-2000:]
    header = [line for line in loaded.stdout.lines if line.startswith("weightsync")]
    assert not header, f"weightsync header lines in an unrelated run: {header}"
    assert _profile_line(loaded) == _profile_line(without), (
        f"hypothesis settings with the plugin: {_profile_line(loaded)}; without: {_profile_line(without)}"
    )
    written = [str(p) for p in pytester.path.rglob("*.json")]
    assert not written, f"files written by an unrelated run: {written}"
    fixtures = pytester.runpytest_subprocess("--fixtures", "-p", "no:randomly", "-p", "no:cacheprovider")
    out = fixtures.stdout.str()
    assert "weightsync_deployment" in out, out[-2000:]  # the plugin's fixtures are there, prefixed
    bare = [name for name in BARE_FIXTURES if re.search(rf"^{name}\b", out, re.M)]
    assert not bare, f"fixtures without the weightsync_ prefix: {bare}"


def test_the_hypothesis_profile_is_loaded_only_through_its_option(pytester):
    pytester.makepyfile(test_plain=PLAIN)
    args = ("-s", "-p", "no:randomly", "-p", "no:cacheprovider", "--weightsync-backend=disk")
    default = pytester.runpytest_subprocess(*args)
    thorough = pytester.runpytest_subprocess(*args, "--weightsync-hypothesis-profile=thorough")
    wrong = pytester.runpytest_subprocess(*args, "--weightsync-hypothesis-profile=nope")
    assert _profile_line(default) == "PROFILE=weightsync-ci MAX_EXAMPLES=20", default.stdout.str()[-2000:]
    assert _profile_line(thorough) == "PROFILE=weightsync-thorough MAX_EXAMPLES=300", thorough.stdout.str()[
        -2000:
    ]
    default.stdout.fnmatch_lines(["weightsync: engine=* hypothesis profile=weightsync-ci"])
    assert wrong.ret == pytest.ExitCode.USAGE_ERROR, wrong.stderr.str()
    wrong.stderr.fnmatch_lines(["ERROR: --weightsync-hypothesis-profile='nope'*"])


def test_not_supported_is_a_status_of_its_own_and_an_ordinary_skip_stays_a_skip(pytester):
    pytester.makepyfile(
        test_caps="""
        import pytest

        @pytest.mark.requires("ipc")
        def test_needs_ipc(ws_target):
            pass

        def test_skips_for_its_own_reason():
            pytest.skip("an ordinary reason")
        """
    )
    results = pytester.path / "results.json"
    args = ("-p", "no:randomly", "-p", "no:cacheprovider", "--weightsync-backend=disk")
    args += ("--weightsync-receivers=1", f"--weightsync-results={results}")
    verbose = pytester.runpytest_subprocess(*args, "-v", "-rs")
    verbose.stdout.fnmatch_lines(
        [
            "*test_needs_ipc?disk-1rx? NOT_SUPPORTED*",
            "*test_skips_for_its_own_reason SKIPPED*",
            "NOT_SUPPORTED [[]1] backend 'disk' does not claim [[]'ipc']",
            "SKIPPED [[]1] *an ordinary reason",
        ]
    )
    outcomes = verbose.parseoutcomes()
    assert outcomes.get("not_supported") == 1 and outcomes.get("skipped") == 1, outcomes
    assert verbose.ret == 0, verbose.stdout.str()[-2000:]
    statuses = {
        k.rsplit("::", 1)[-1]: v["status"] for k, v in json.loads(results.read_text())["tests"].items()
    }
    assert statuses == {
        "test_needs_ipc[disk-1rx]": "not_supported",
        "test_skips_for_its_own_reason": "skipped",
    }, statuses
    short = pytester.runpytest_subprocess(*args)
    short.stdout.fnmatch_lines(["test_caps.py Ns*"])


def test_a_known_failure_is_a_strict_xfail_and_its_fix_fails_the_run(pytester):
    """--weightsync-xfails-file: a listed test that fails is xfailed with the file's reason; a listed test that
    passes (the framework fixed it) is an XPASS that fails the run; a malformed line is a usage error."""
    pytester.makepyfile(
        test_known="""
        import pytest

        @pytest.mark.parametrize("n", [1, 2])
        def test_still_broken(n):
            assert n < 0, f"n={n}"

        @pytest.mark.parametrize("dtype", ["BF16", "F8"])
        def test_broken_for_one_dtype(dtype):
            assert dtype == "F8"

        def test_fixed_upstream():
            pass

        def test_unlisted():
            pass
        """
    )
    xfails = pytester.path / "xfails.txt"
    xfails.write_text(
        "# known failures\n\n"
        "test_known.py::test_still_broken  # finding 1: negative n only\n"
        "test_known.py::test_fixed_upstream  # finding 2\n"
        "test_known.py::test_broken_for_one_dtype[*BF16]  # finding 3\n"
    )
    args = ("-p", "no:randomly", "-p", "no:cacheprovider", "--weightsync-backend=disk", "-rxX")
    result = pytester.runpytest_subprocess(*args, f"--weightsync-xfails-file={xfails}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("xfailed") == 3 and outcomes.get("failed") == 1, outcomes
    assert outcomes.get("passed") == 2, outcomes  # test_unlisted, test_broken_for_one_dtype[F8]
    result.stdout.fnmatch_lines(
        ["*XPASS(strict)*known failure: finding 2*", "*known failure: finding 1: negative n only*"]
    )
    assert result.ret == 1
    xfails.write_text("test_still_broken is broken\n")
    bad = pytester.runpytest_subprocess(*args, f"--weightsync-xfails-file={xfails}")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR, bad.stderr.str()
    bad.stderr.fnmatch_lines(["*xfails.txt:1: 'test_still_broken is broken' is not a test id*"])
