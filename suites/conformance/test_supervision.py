"""Supervision of receiver ranks: a rank that dies or hangs fails the sync within the configured
timeout, names itself, dumps its Python stacks, and the surviving engines keep their version."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fixtures.payloads import random_like_spec
from harness.api import TransferError
from harness.deployment import push
from harness.paths.broadcast import BroadcastBackend

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 5.0


def _weights(dep, seed):
    return random_like_spec(dep.handles[0].engine.weight_spec(), seed=seed)


def test_killed_rank_fails_the_sync_in_bounded_time(tmp_path):
    with BroadcastBackend(timeout_s=TIMEOUT_S).deploy(2, None, str(tmp_path)) as dep:
        push(dep, 1, _weights(dep, 1))
        victim = dep.ranks[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.process.join(10)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            push(dep, 2, _weights(dep, 2))
        elapsed = time.monotonic() - t0
        assert elapsed < 4 * TIMEOUT_S, f"the failure took {elapsed:.1f}s with a {TIMEOUT_S}s timeout"
        assert "rank 2" in str(info.value) and "died" in str(info.value), str(info.value)
        survivor = dep.handles[0]
        assert survivor.engine.weight_version == 1, f"survivor moved to version {survivor.engine.weight_version}"
        survivor.receiver.start_weight_update()  # the failed push left it ready, not mid-update
        survivor.receiver.abort_weight_update()


def test_hung_rank_is_killed_with_its_stacks_dumped(tmp_path):
    backend = BroadcastBackend(timeout_s=TIMEOUT_S)
    with backend.deploy(2, None, str(tmp_path), engine="suites.conformance.stalling:make_stalling_engine") as dep:
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            push(dep, 1, _weights(dep, 1))  # finish hangs in commit_weights on every rank
        elapsed = time.monotonic() - t0
        assert elapsed < 4 * TIMEOUT_S, f"the hang surfaced after {elapsed:.1f}s with a {TIMEOUT_S}s timeout"
        message = str(info.value)
        assert "no reply to finish_weight_update" in message, message
        log = (tmp_path / "ranks" / "rank1.log").read_text()
        assert "commit_weights" in log and "Thread" in log, f"no stack dump in the rank log:\n{log[-2000:]}"
