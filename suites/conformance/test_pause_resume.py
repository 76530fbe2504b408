"""Invariants 4 and 6: pause modes with requests in flight while a new version is pushed.

Every token carries the version that produced it. abort and wait must never let a request span two
versions; keep does by design, and then the boundary must be clean (old tokens, then new ones).
Nothing is lost: every request sent ends completed or aborted.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from fixtures.payloads import random_like_spec
from harness.deployment import push
from harness.pytest_plugin import NOT_SUPPORTED
from suites.conformance.helpers import (
    ABORTED_LEN,
    LONG,
    kept_in_flight,
    pause_request,
    requests_in_flight,
)

pytestmark = [pytest.mark.single_receiver, pytest.mark.requires("pause_modes")]


def _new_version(deployment, version):
    push(deployment, version, random_like_spec(deployment.handles[0].engine.weight_spec(), seed=version))


def _versions(c):
    return sorted(c.versions_seen)


def test_abort_ends_in_flight_with_partial_output(weightsync_deployment, weightsync_backend):
    engine = weightsync_deployment.handles[0].engine
    streams = requests_in_flight(engine, max_tokens=ABORTED_LEN)
    engine.pause("abort")
    assert engine.is_paused
    results = [s.result(timeout=30) for s in streams]
    for c in results:
        assert c.finish_reason == "abort", (
            f"{c.request_id}: finish_reason {c.finish_reason!r}, expected 'abort'"
        )
        assert 2 <= len(c.token_ids) < ABORTED_LEN, (
            f"{c.request_id}: {len(c.token_ids)} tokens; expected partial output"
        )
        assert _versions(c) == [0], f"{c.request_id}: aborted request saw versions {_versions(c)}"
    queued = engine.submit(pause_request(8))  # arrives while paused: must wait for resume
    _new_version(weightsync_deployment, 1)
    assert not queued.done, "a request sent while paused finished before resume"
    engine.resume()
    after = queued.result(timeout=60)
    assert after.finish_reason == "length" and _versions(after) == [1], (
        f"request sent while paused: {after.finish_reason!r}, versions {_versions(after)}; expected length on [1]"
    )


def test_wait_lets_in_flight_finish_on_the_old_version(weightsync_deployment, weightsync_backend):
    engine = weightsync_deployment.handles[0].engine
    streams = requests_in_flight(engine, tokens=1)
    engine.pause("wait")  # returns only once the in-flight requests are done
    assert all(s.done for s in streams), "pause(wait) returned while requests were still running"
    _new_version(weightsync_deployment, 1)
    engine.resume()
    for c in (s.result(timeout=5) for s in streams):
        assert c.finish_reason == "length" and len(c.token_ids) == LONG, (
            f"{c.request_id}: {c.finish_reason!r} after {len(c.token_ids)} tokens; expected a full run"
        )
        assert _versions(c) == [0], f"{c.request_id}: spans versions {_versions(c)} under pause(wait)"


def test_keep_freezes_and_continues_on_the_new_version(weightsync_deployment, weightsync_backend):
    engine = weightsync_deployment.handles[0].engine
    streams, frozen, max_tokens = kept_in_flight(engine)
    _new_version(weightsync_deployment, 1)
    engine.resume()
    for s, at_pause in zip(streams, frozen):
        c = s.result(timeout=120)
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens, (
            f"{c.request_id}: {c.finish_reason!r} after {len(c.token_ids)} tokens; keep must continue it"
        )
        # keep spans two versions by design: the report shows where, and the boundary must be clean
        first_new = c.token_versions.index(1) if 1 in c.token_versions else len(c.token_versions)
        assert c.token_versions == [0] * first_new + [1] * (max_tokens - first_new), (
            f"{c.request_id}: token versions {c.token_versions} are not old-then-new"
        )
        assert first_new == at_pause < max_tokens, (
            f"{c.request_id}: {first_new} tokens on version 0, {at_pause} produced before pause (of {max_tokens})"
        )


def test_token_stamps_are_the_generating_version_when_read_late(weightsync_deployment):
    """A client that reads its stream only after the next version committed still sees each token
    stamped with the version that generated it: the stamp is taken when the token is made, not when
    it is read. Version 0 made every token of the first request (it ran to its end under pause(wait)
    before the push), version 1 every token of the second; none was read before the commit."""
    engine = weightsync_deployment.handles[0].engine
    held = getattr(engine, "reads_held", None)  # an in-process stream is read here, late
    # Reads held from the submit on: a first read that came after the engine made every token (a busy
    # host) would stamp them all on version 0 and hide a stamp taken when read.
    with held() if held else contextlib.nullcontext():
        before = engine.submit(pause_request(LONG))
        if held is None:
            assert before.wait_for_tokens(1, timeout=60), "the first request produced no token"
        engine.pause("wait")  # the first request runs to its end on version 0; none of it is read yet
        _new_version(weightsync_deployment, 1)
        engine.resume()
        after = engine.submit(pause_request(8))
    first, second = before.result(timeout=60), after.result(timeout=60)
    assert first.finish_reason == "length" and first.token_versions == [0] * LONG, (
        f"{first.request_id}: made on version 0 and read after version 1 committed, its tokens are "
        f"stamped {first.token_versions} ({first.finish_reason!r}): the stamp is taken when read"
    )
    assert second.token_versions == [1] * len(second.token_ids) and second.token_ids, (
        f"{second.request_id}: made on version 1, stamped {second.token_versions}"
    )


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_nothing_is_lost(weightsync_deployment, mode):
    """sent = completed + aborted, counted, across a pause, an update and a resume."""
    engine = weightsync_deployment.handles[0].engine
    sent = [engine.submit(pause_request(LONG if i % 2 else 6)) for i in range(6)]
    sent[0].wait_for_tokens(1, timeout=60)
    engine.pause(mode)
    sent += [engine.submit(pause_request(6)) for _ in range(3)]
    _new_version(weightsync_deployment, 1)
    engine.resume()
    results = [s.result(timeout=60) for s in sent]
    completed = sum(c.finish_reason == "length" for c in results)
    aborted = sum(c.finish_reason == "abort" for c in results)
    assert completed + aborted == len(sent), (
        f"pause({mode}): sent {len(sent)}, completed {completed}, aborted {aborted}: "
        f"{[(c.request_id, c.finish_reason) for c in results]}"
    )
    if mode != "abort":
        assert aborted == 0, f"pause({mode}) aborted {aborted} request(s)"
    if mode != "keep":
        mixed = [c.request_id for c in results if len(c.versions_seen) > 1]
        assert not mixed, f"pause({mode}): requests {mixed} mix two versions"


def test_abort_by_id_ends_only_that_request(weightsync_deployment):
    engine = weightsync_deployment.handles[0].engine
    try:
        victim, bystander = requests_in_flight(engine, n=2, max_tokens=ABORTED_LEN)
        assert engine.abort_requests([victim.request.request_id, "no-such-request"]) == 1
    except NotImplementedError:
        pytest.skip("NOT_SUPPORTED: the engine cannot abort requests by id")
    c = victim.result(timeout=30)
    assert c.finish_reason == "abort" and 2 <= len(c.token_ids) < ABORTED_LEN, (
        f"aborted request: {c.finish_reason!r} after {len(c.token_ids)} tokens"
    )
    assert not bystander.done or bystander.result().finish_reason == "length", (
        "the other request was aborted too"
    )
    engine.pause("abort")  # end the bystander; nothing else may be left running
    engine.resume()
    assert bystander.result(timeout=30).finish_reason in ("abort", "length")


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_reaches_requests_queued_behind_the_batch(weightsync_deployment, mode):
    """More requests than the engine runs at once: the queued, never-scheduled ones are in flight too.
    abort ends every one (partial output, none for the queued); wait finishes every one on the old
    version before it returns; keep loses none, each old-then-new."""
    engine = weightsync_deployment.handles[0].engine
    limit = engine.max_running_requests
    if limit is None:
        pytest.skip(f"{NOT_SUPPORTED}: the engine does not say how many requests it runs at once")
    # abort: long enough that every request is still open at the pause; keep: a request that finished
    # before the pause lands is fine (all its tokens on version 0), the queued ones are what matters
    max_tokens = ABORTED_LEN if mode == "abort" else LONG
    # sent while paused, they all arrive at resume: a batch starts and the rest queue behind it (sent one by
    # one to a running engine, the first could run to their end before the last arrived)
    engine.pause("keep")
    streams = [engine.submit(pause_request(max_tokens, (3, 1, 4, i % 7 + 1))) for i in range(2 * limit + 1)]
    engine.resume()
    assert streams[0].wait_for_tokens(1, timeout=60), "the first request produced no tokens"
    engine.pause(mode)
    frozen = [s.token_count for s in streams]
    context = f"pause({mode}) with {len(streams)} requests, {limit} run at once"
    if mode == "abort":  # every one ends at the pause, not after resume (10 s for the ends to reach us)
        deadline = time.monotonic() + 10
        for s in streams:
            s.wait_for_tokens(max_tokens, timeout=max(0.0, deadline - time.monotonic()))
        left = [s.request.request_id for s in streams if not s.done]
        assert not left, (
            f"{context}: {len(left)} request(s) still open 10 s after pause(abort) returned: {left}"
        )
    if mode == "wait":
        unfinished = [s.request.request_id for s in streams if not s.done]
        assert not unfinished, (
            f"pause(wait) returned with {len(unfinished)} of {len(streams)} requests unfinished"
        )
    _new_version(weightsync_deployment, 1)
    engine.resume()
    results = [s.result(timeout=120) for s in streams]
    outcome = [(c.finish_reason, len(c.token_ids)) for c in results]
    if mode == "abort":
        assert all(c.finish_reason == "abort" for c in results), f"{context}: (finish, tokens) {outcome}"
        assert all(len(c.token_ids) < max_tokens and _versions(c) in ([], [0]) for c in results), (
            f"{context}: a request ran on after pause(abort): {outcome}"
        )
        return
    assert all(c.finish_reason == "length" and len(c.token_ids) == max_tokens for c in results), (
        f"{context}: every request must run to its end, (finish, tokens): {outcome}"
    )
    for c, at_pause in zip(results, frozen):
        if mode == "wait":
            assert _versions(c) == [0], f"{context}: {c.request_id} spans versions {_versions(c)}"
        else:
            n_old = c.token_versions.count(0)
            assert c.token_versions == [0] * n_old + [1] * (max_tokens - n_old) and n_old == at_pause, (
                f"{context}: {c.request_id} had {at_pause} tokens at the pause, token versions "
                f"{c.token_versions[: at_pause + 3]}...: not old-until-the-pause then new"
            )
