"""Supervision of receiver ranks, for the backend under test: a rank that hangs fails the sync within
the configured timeout, names itself and dumps its Python stacks; a rank that died is restarted by the
next push, whose engine then converges; the surviving engines keep their version throughout.
(Deaths and stalls at every point of a transfer: suites/faults.) Versions are consecutive trainer steps
(harness.faults.cell.cell_versions), as the fault cells push: a patch path sends the push after a
restart as a patch unless it forgot its base, so a restarted engine at version 0 shows whether it did."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness.api import RankFailure
from harness.checks import assert_bitwise_equal
from harness.deadline import declared_timeouts, over_bound
from harness.deployment import push
from harness.faults.cell import cell_versions, with_timeout

pytestmark = [pytest.mark.multiproc, pytest.mark.single_receiver]

TIMEOUT_S = 3.0


def _deploy(backend, n, tmp_path, engine=None):
    if engine is not None and getattr(backend, "own_engine", None):
        pytest.skip(f"NOT_SUPPORTED: backend {backend.name!r} takes no engine factory: {backend.own_engine}")
    dep = with_timeout(backend, TIMEOUT_S).deploy(n, None, str(tmp_path), engine=engine)
    if not dep.processes():
        dep.close()
        pytest.skip(
            f"NOT_SUPPORTED: backend {backend.name!r} exposes no rank processes (Deployment.processes())"
        )
    return dep


@pytest.mark.not_quick  # 4 s
def test_rank_killed_between_syncs_is_restarted_by_the_next_push(
    weightsync_backend, weightsync_n_receivers, tmp_path
):
    with _deploy(weightsync_backend, weightsync_n_receivers, tmp_path) as dep:
        # the trainer's side of the spec, read while every rank is up: at 1 receiver the victim is the
        # only engine there is, and a dead rank has no spec to give
        spec = dep.handles[0].engine.weight_spec()
        versions = cell_versions(spec, seed=1)  # version 2 is version 1 one trainer step later
        push(dep, 1, versions[1])
        victim = dep.processes()[-1]
        os.kill(victim.pid, signal.SIGKILL)
        push(dep, 2, versions[2])  # no redeploy by hand; the restarted engine holds version 0
        now = dep.processes()[-1]
        assert now.pid != victim.pid, f"{victim.name} (pid {victim.pid}) was killed but not replaced"
        for i, h in enumerate(dep.handles):
            assert h.engine.weight_version == 2, (
                f"engine {i} serves {h.engine.weight_version} after the push of 2"
            )
            assert_bitwise_equal(versions[2], h.engine.read_weights(), f"engine {i} after the push of 2")


@pytest.mark.not_quick  # 8 s
@pytest.mark.serial  # the hang must surface within 2x the timeout
def test_hung_rank_is_killed_with_its_stacks_dumped(weightsync_backend, weightsync_n_receivers, tmp_path):
    with _deploy(
        weightsync_backend,
        weightsync_n_receivers,
        tmp_path,
        engine="suites.conformance.stalling:make_stalling_engine",
    ) as dep:
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            push(
                dep, 1, cell_versions(dep.handles[0].engine.weight_spec(), seed=1, n=1)[1]
            )  # finish hangs in commit_weights on every rank
        elapsed = time.monotonic() - t0
        assert elapsed < 2 * TIMEOUT_S, f"the hang surfaced after {elapsed:.1f}s with a {TIMEOUT_S}s timeout"
        message = str(info.value)
        first = dep.processes()[0]
        assert "no reply to finish_weight_update" in message and first.name in message, message
        log = Path(first.log_path).read_text()
        assert "commit_weights" in log and "Thread" in log, (
            f"no stack dump in {first.log_path}:\n{log[-2000:]}"
        )


def test_declared_timeouts_follow_the_timeout_it_is_given(weightsync_backend):
    """Every wait the backend declares (Backend.timeouts(), else timeout_s) follows the timeout it is
    given: one left at a library default (NCCL's 30 minutes) would hold a stalled sync that long."""
    over = over_bound(with_timeout(weightsync_backend, TIMEOUT_S), TIMEOUT_S)
    assert not over, (
        f"{weightsync_backend.name} given timeout_s={TIMEOUT_S:g} still declares {over} "
        f"(all it declares: {declared_timeouts(with_timeout(weightsync_backend, TIMEOUT_S))})"
    )
