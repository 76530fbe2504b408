"""Invariants 4 and 6: pause modes with requests in flight while a new version is pushed.

Every token carries the version that produced it. abort and wait must never let a request span two
versions; keep does by design, and then the boundary must be clean (old tokens, then new ones).
Nothing is lost: every request sent ends completed or aborted.
"""

from __future__ import annotations

import itertools

import pytest

from fixtures.payloads import random_like_spec
from harness.api import GenerationRequest
from harness.deployment import push

pytestmark = [pytest.mark.single_receiver, pytest.mark.requires("pause_modes")]

LONG = 48  # tokens of a request that is expected to run to its end
# Requests that must still be running when pause arrives: an engine in another process runs ahead
# of what the caller has seen, so they are long enough for any engine to be caught mid-way.
ABORTED_LEN = 4096
KEPT_LEN = 512
_ids = itertools.count()


def _request(max_tokens=LONG, prompt=(3, 1, 4, 1, 5, 9, 2, 6)):
    return GenerationRequest(f"pause-{next(_ids)}", prompt, max_tokens)


def _in_flight(engine, n=2, tokens=2, max_tokens=LONG):
    """n streaming requests that have each produced at least `tokens` tokens."""
    streams = [engine.submit(_request(max_tokens)) for _ in range(n)]
    for s in streams:
        assert s.wait_for_tokens(tokens, timeout=60), f"request {s.request.request_id} produced no tokens"
    return streams


def _new_version(deployment, version):
    push(deployment, version, random_like_spec(deployment.handles[0].engine.weight_spec(), seed=version))


def _versions(c):
    return sorted(c.versions_seen)


def test_abort_ends_in_flight_with_partial_output(deployment, backend):
    engine = deployment.handles[0].engine
    streams = _in_flight(engine, max_tokens=ABORTED_LEN)
    engine.pause("abort")
    assert engine.is_paused
    results = [s.result(timeout=30) for s in streams]
    for c in results:
        assert c.finish_reason == "abort", f"{c.request_id}: finish_reason {c.finish_reason!r}, expected 'abort'"
        assert 2 <= len(c.token_ids) < ABORTED_LEN, f"{c.request_id}: {len(c.token_ids)} tokens; expected partial output"
        assert _versions(c) == [0], f"{c.request_id}: aborted request saw versions {_versions(c)}"
    queued = engine.submit(_request(8))  # arrives while paused: must wait for resume
    _new_version(deployment, 1)
    assert not queued.done, "a request sent while paused finished before resume"
    engine.resume()
    after = queued.result(timeout=60)
    assert after.finish_reason == "length" and _versions(after) == [1], (
        f"request sent while paused: {after.finish_reason!r}, versions {_versions(after)}; expected length on [1]"
    )


def test_wait_lets_in_flight_finish_on_the_old_version(deployment, backend):
    engine = deployment.handles[0].engine
    streams = _in_flight(engine, tokens=1)
    engine.pause("wait")  # returns only once the in-flight requests are done
    assert all(s.done for s in streams), "pause(wait) returned while requests were still running"
    _new_version(deployment, 1)
    engine.resume()
    for c in (s.result(timeout=5) for s in streams):
        assert c.finish_reason == "length" and len(c.token_ids) == LONG, (
            f"{c.request_id}: {c.finish_reason!r} after {len(c.token_ids)} tokens; expected a full run"
        )
        assert _versions(c) == [0], f"{c.request_id}: spans versions {_versions(c)} under pause(wait)"


def _kept_in_flight(engine):
    """Requests caught mid-way by pause(keep): (streams, tokens each had at the pause, max_tokens). A fast
    engine can finish a request between the caller seeing its first tokens and the pause landing; then
    nothing is left to continue on the new version, and the scenario is run again with longer requests
    (within a 4096-token context: a prompt of 8 and 3584 new tokens fit)."""
    for max_tokens in (KEPT_LEN, 4 * KEPT_LEN, 7 * KEPT_LEN):
        streams = _in_flight(engine, max_tokens=max_tokens)
        engine.pause("keep")
        frozen = [s.token_count for s in streams]
        if all(f < max_tokens for f in frozen):
            return streams, frozen, max_tokens
        engine.resume()  # one finished before the pause: let the rest run out, and try longer ones
        for s in streams:
            s.result(timeout=120)
    pytest.fail(f"every attempt: a request of up to {max_tokens} tokens finished before pause(keep) landed "
                f"(tokens at the pause: {frozen})")


def test_keep_freezes_and_continues_on_the_new_version(deployment, backend):
    engine = deployment.handles[0].engine
    streams, frozen, max_tokens = _kept_in_flight(engine)
    _new_version(deployment, 1)
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


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_nothing_is_lost(deployment, mode):
    """sent = completed + aborted, counted, across a pause, an update and a resume."""
    engine = deployment.handles[0].engine
    sent = [engine.submit(_request(LONG if i % 2 else 6)) for i in range(6)]
    sent[0].wait_for_tokens(1, timeout=60)
    engine.pause(mode)
    sent += [engine.submit(_request(6)) for _ in range(3)]
    _new_version(deployment, 1)
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


def test_abort_by_id_ends_only_that_request(deployment):
    engine = deployment.handles[0].engine
    try:
        victim, bystander = _in_flight(engine, n=2, max_tokens=ABORTED_LEN)
        assert engine.abort_requests([victim.request.request_id, "no-such-request"]) == 1
    except NotImplementedError:
        pytest.skip("NOT_SUPPORTED: the engine cannot abort requests by id")
    c = victim.result(timeout=30)
    assert c.finish_reason == "abort" and 2 <= len(c.token_ids) < ABORTED_LEN, (
        f"aborted request: {c.finish_reason!r} after {len(c.token_ids)} tokens"
    )
    assert not bystander.done or bystander.result().finish_reason == "length", "the other request was aborted too"
    engine.pause("abort")  # end the bystander; nothing else may be left running
    engine.resume()
    assert bystander.result(timeout=30).finish_reason in ("abort", "length")
