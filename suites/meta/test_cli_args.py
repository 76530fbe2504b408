"""Every argument of bench, certify, validate-cluster and cost is checked before anything runs: a bad value is a
usage error (exit 2) within USAGE_BOUND_S whose message names the option, the value and what is allowed, and
leaves no folder and no process behind (issue 40, item 1)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import main
from harness.stopping import descendants

pytestmark = pytest.mark.meta

USAGE_BOUND_S = 2.0
ROOT = Path(__file__).resolve().parents[2]

nonpositive = st.integers(max_value=0).map(str)
not_a_number = st.sampled_from(["x", "1.5", "", "one", "0x10", "nan"])
bad_ratio = st.one_of(
    st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
    st.floats(min_value=1.0, exclude_min=True, allow_nan=False),
)
bad_fraction = st.one_of(bad_ratio, st.just("nan"), st.just("inf")).map(str)
bad_floor = st.one_of(
    bad_ratio.map(lambda r: f"disk={r}"),
    st.sampled_from(["disk", "=0.5", "disk=fast", "disk=", " =0.3"]),
)
bad_device = st.one_of(st.sampled_from(["gpu", "cuda:x", "CUDA", "cuda:", "tpu:0"]), st.just("cuda:99"))
bad_ranks = st.sampled_from(["3-1", "a", "1-", "-1", "0,,1", "1,1", "0-2,2"])


@st.composite
def bad_arguments(draw):
    """(argv without --out, the option, the bad value, a word of what is allowed)."""
    choice = draw(
        st.sampled_from(
            [
                ("bench", "--sizes-mib", st.one_of(nonpositive, not_a_number), "1 or more"),
                ("bench", "--receivers", st.one_of(nonpositive, not_a_number), "1 or more"),
                ("bench", "--repeats", st.one_of(nonpositive, not_a_number), "1 or more"),
                ("bench", "--bucket-mib", nonpositive, "1 or more"),
                ("bench", "--delta-fractions", bad_fraction, "at most 1"),
                ("bench", "--floor", bad_floor, "RATIO in (0, 1]"),
                ("bench", "--device", bad_device, "cpu"),
                ("certify", "--sizes-mib", st.one_of(nonpositive, not_a_number), "1 or more"),
                ("certify", "--repeats", st.one_of(nonpositive, not_a_number), "1 or more"),
                ("certify", "--jobs", st.one_of(nonpositive, st.just("many")), "'auto' or"),
                ("certify", "--receivers", st.sampled_from(["0", "1,0", "two", "2,", "-1"]), "'auto' or"),
                ("certify", "--floor", bad_floor, "RATIO in (0, 1]"),
                ("certify", "--device", bad_device, "cpu"),
                ("validate-cluster", "--trainer-ranks", bad_ranks, "N-M"),
                (
                    "validate-cluster",
                    "--sizes-mib",
                    st.sampled_from(["0", "-1", "x", "inf"]),
                    "greater than 0",
                ),
                ("validate-cluster", "--repeats", nonpositive, "1 or more"),
                ("validate-cluster", "--timeout-s", st.sampled_from(["0", "-5", "nan"]), "greater than 0"),
                ("validate-cluster", "--floor", bad_fraction, "at most 1"),
                ("cost", "--gpus", nonpositive, "greater than 0"),
                ("cost", "--steps", nonpositive, "greater than 0"),
                ("cost", "--fabric-efficiency", bad_fraction, "at most 1"),
            ]
        )
    )
    command, option, values, allowed = choice
    value = draw(values)
    argv = [command, f"{option}={value}"]  # =: a value that starts with '-' is not read as an option
    if command == "validate-cluster":
        if option != "--trainer-ranks":
            argv += ["--trainer-ranks", "0"]
        argv += ["--rollout-ranks", "1"]
    if command == "cost":
        argv += ["--sync-s", "1"]
    return argv, option, value, allowed


def _refused(argv: list[str]) -> tuple[int, str, float]:
    """main(argv) in this process: (exit status, stderr, seconds)."""
    err = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = exc.code
    return status, err.getvalue(), time.monotonic() - t0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_arguments())
def test_a_bad_argument_is_a_usage_error_that_names_it_and_runs_nothing(drawn):
    argv, option, value, allowed = drawn
    before = set(descendants())
    with tempfile.TemporaryDirectory() as out:
        if argv[0] != "cost":
            argv = [*argv, "--out", out]
        status, err, took = _refused(argv)
        made = sorted(os.listdir(out))
    rerun = f"python -m harness.cli {' '.join(argv)}"
    assert status == 2, f"exit {status}, expected 2 (usage error) for {rerun}:\n{err[-1500:]}"
    text = " ".join(err.split())  # the terminal's line breaks
    assert option.lstrip("-") in text and str(value).strip() in text, (
        f"the refusal does not name {option} and its value {value!r} ({rerun}):\n{err[-1500:]}"
    )
    assert allowed in text, (
        f"the refusal does not say what is allowed ({allowed!r}) for {rerun}:\n{err[-1500:]}"
    )
    assert took < USAGE_BOUND_S, f"{rerun} took {took:.2f} s to refuse (bound {USAGE_BOUND_S} s)"
    assert not made, f"{rerun} left {made} in its --out folder"
    left = set(descendants()) - before
    assert not left, f"{rerun} left processes {sorted(left)}"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--trainer-ranks", "0-1", "--rollout-ranks", "1"],
            "rank 1 is in --trainer-ranks 0,1 and in --rollout-ranks",
        ),
        (["--trainer-ranks", "0", "--rollout-ranks", "1-2", "--rollout-ranks", "2"], "disjoint"),
    ],
)
def test_validate_cluster_refuses_rank_lists_that_overlap(argv, says):
    status, err, _ = _refused(["validate-cluster", *argv])
    assert status == 2 and says in " ".join(err.split()), f"exit {status}:\n{err[-1500:]}"


def test_validate_cluster_refuses_ranks_outside_the_world_torchrun_started(monkeypatch):
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    status, err, _ = _refused(["validate-cluster", "--trainer-ranks", "0", "--rollout-ranks", "1-3"])
    assert status == 2 and "ranks [2, 3] named, but torchrun started 2" in " ".join(err.split()), err[-1500:]


def test_the_real_entry_point_exits_2_at_once_and_writes_nothing(tmp_path):
    """The issue's first row: `weightsync bench --sizes-mib -5` ran rows of 0 MiB."""
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--sizes-mib", "-5", "--out", str(tmp_path)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    took = time.monotonic() - t0
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr[-1500:]}"
    assert "argument --sizes-mib: '-5': a whole number of MiB, 1 or more" in proc.stderr, proc.stderr[-1500:]
    assert took < USAGE_BOUND_S, f"the usage error took {took:.2f} s, interpreter start included"
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())
