"""Invariant 8 for the collocated path: handles are released after every sync, and a receiver given a
stale or foreign handle gets a clear error while the engine keeps its version."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fixtures.payloads import random_like_spec
from harness.api import TransferError
from harness.deployment import push
from harness.paths.ipc import own_segments
from harness.trainer import ReferenceTrainer
from suites.conformance.helpers import assert_unchanged, snapshot

pytestmark = [pytest.mark.requires("ipc"), pytest.mark.single_receiver]


def _ipc_part(info):
    """The ipc transport's own update_info (nested under 'payload' when delta rides on it)."""
    return info.get("payload", info)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mapped_segments(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [line for line in maps.splitlines() if "/dev/shm/wsync-" in line]


def test_no_segment_fd_or_mapping_outlives_its_sync(weightsync_deployment):
    trainer = ReferenceTrainer(weightsync_deployment.handles[0].engine.weight_spec(), seed=21)
    push(weightsync_deployment, *trainer.step())
    segments, fds = own_segments(), _open_fds()  # this trainer's: another job's segments are not this test's
    for _ in range(60):
        push(weightsync_deployment, *trainer.step())
    assert own_segments() == segments, f"segments left behind: {sorted(set(own_segments()) - set(segments))}"
    assert _open_fds() <= fds, f"trainer process holds {_open_fds()} fds after 60 syncs, {fds} before"
    for rank in getattr(weightsync_deployment, "ranks", []):
        assert not _mapped_segments(rank.pid), f"rank {rank.rank} still maps: {_mapped_segments(rank.pid)}"


def _deliver_forged(deployment, forge):
    weights = random_like_spec(deployment.handles[0].engine.weight_spec(), seed=5)
    info = deployment.sender.prepare(1, weights)
    forge(info)
    errors = []
    for h in deployment.handles:
        h.receiver.start_weight_update()
        try:
            h.receiver.update_weights(info)
        except TransferError as exc:
            errors.append(str(exc))
        finally:
            h.receiver.abort_weight_update()
    deployment.sender.complete(False)
    return errors


def test_stale_handle_is_refused(weightsync_deployment):
    before = snapshot(weightsync_deployment)

    def release_first(info):
        weightsync_deployment.sender.complete(False)  # the segments are gone before the engine maps them

    errors = _deliver_forged(weightsync_deployment, release_first)
    assert len(errors) == len(weightsync_deployment.handles) and all("stale handle" in e for e in errors), (
        errors
    )
    assert_unchanged(weightsync_deployment, before, "after a stale handle")


@pytest.mark.parametrize("how", ["token", "name"])
def test_foreign_handle_is_refused(weightsync_deployment, how):
    before = snapshot(weightsync_deployment)

    def forge(info):
        part = _ipc_part(info)
        if how == "token":
            part["token"] = "ab" * 16  # another sync's buffers
        else:
            for b in part["buffers"]:
                if "shm" in b:
                    b["shm"] = "psm_not_ours"
                else:
                    b["cuda"]["offset"] += 16

    errors = _deliver_forged(weightsync_deployment, forge)
    assert len(errors) == len(weightsync_deployment.handles) and all("foreign" in e for e in errors), errors
    assert_unchanged(weightsync_deployment, before, f"after a foreign handle ({how})")
