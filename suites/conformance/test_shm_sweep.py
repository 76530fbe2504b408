"""The sweep of segments a dead trainer left in /dev/shm (harness.paths.ipc.sweep_abandoned_segments) removes
this user's only: on a shared host another user's segment, named as ours, is theirs to release."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.paths.ipc import SEGMENT_PREFIX, sweep_abandoned_segments


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _segment(pid: int, tag: str) -> str:
    name = f"{SEGMENT_PREFIX}{pid}-sweep-test-{tag}-{os.getpid()}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"x")
    return name


def test_a_dead_trainers_segment_is_swept_and_a_live_ones_kept():
    dead, live = _segment(_dead_pid(), "dead"), _segment(os.getppid(), "live")
    try:
        removed = sweep_abandoned_segments()
        assert dead in removed and not os.path.exists(f"/dev/shm/{dead}"), removed
        assert live not in removed and os.path.exists(f"/dev/shm/{live}"), removed
    finally:
        for name in (dead, live):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_another_users_segment_of_a_dead_pid_is_left_alone():
    theirs = _segment(_dead_pid(), "theirs")
    os.chown(f"/dev/shm/{theirs}", 65534, 65534)  # nobody's
    try:
        removed = sweep_abandoned_segments()
        assert theirs not in removed and os.path.exists(f"/dev/shm/{theirs}"), (
            f"the sweep removed another user's segment {theirs}: {removed}"
        )
    finally:
        os.unlink(f"/dev/shm/{theirs}")
