"""Pause/resume over HTTP with streaming requests in flight while a version is pushed, per pause mode.

Each token carries the weight version that produced it (the SSE stream's `token_weight_versions`);
a request spanning two versions is reported: expected under keep, a failure under abort and wait.
Nothing is lost: every request sent is counted as completed or aborted, by the client and the server.
"""

from __future__ import annotations

import pytest

from suites.control.helpers import request, span_report, start_streams, update_under_load, wait_tokens

N_IN_FLIGHT, N_QUEUED, QUEUED_TOKENS = 4, 2, 8
LONG = 256  # in-flight requests that must still be running when the pause lands (abort, keep)
SHORT = 48  # in-flight requests under wait, which the pause lets finish


def _check_common(r, record_property) -> None:
    """What every mode promises: the paused engine produced nothing during the push, requests sent
    while paused ran after resume entirely on the new version, and every request is accounted for."""
    record_property("version_spans", r.spans)
    print(r.describe())
    assert len(r.engine_tokens_at_pause) == N_IN_FLIGHT, f"requests finished before the pause:\n{r.describe()}"
    assert r.queued_tokens_before_resume == {rid: 0 for rid in r.queued_tokens_before_resume}, (
        f"requests sent while paused produced tokens before resume: {r.queued_tokens_before_resume}"
    )
    for c in r.queued:
        assert c.finish_reason == "length" and len(c.token_ids) == QUEUED_TOKENS, (
            f"queued {c.request_id}: {len(c.token_ids)} tokens, finish {c.finish_reason}\n{r.describe()}"
        )
        assert c.versions_seen == {1}, f"queued {c.request_id} ran on versions {c.versions_seen}, expected {{1}}"
    assert r.sent == r.completed + r.aborted == N_IN_FLIGHT + N_QUEUED, f"requests lost:\n{r.describe()}"
    stats = r.server_stats
    assert (stats["submitted"], stats["in_flight"], stats["disconnected"]) == (r.sent, 0, 0), (
        f"server-side accounting {stats} disagrees with the client's sent={r.sent}"
    )
    assert (stats["completed"], stats["aborted"]) == (r.completed, r.aborted), (
        f"server counted {stats}, client counted completed={r.completed} aborted={r.aborted}"
    )


def test_abort_ends_in_flight_requests_with_partial_output(served, record_property):
    r = update_under_load(served, "abort", 1, N_IN_FLIGHT, N_QUEUED, max_tokens=LONG, queued_tokens=QUEUED_TOKENS)
    _check_common(r, record_property)
    assert all(r.engine_done_at_pause.values()), f"in-flight requests still running after /pause?mode=abort: {r.engine_done_at_pause}"
    for c in r.in_flight:
        assert c.finish_reason == "abort", f"{c.request_id}: finish {c.finish_reason}, expected abort\n{r.describe()}"
        assert 2 <= len(c.token_ids) < LONG, f"{c.request_id}: {len(c.token_ids)} tokens is not a partial output"
        assert len(c.token_ids) == r.engine_tokens_at_pause[c.request_id], (
            f"{c.request_id}: client got {len(c.token_ids)} tokens, engine produced {r.engine_tokens_at_pause[c.request_id]}"
        )
    assert not r.spans, f"requests span two versions under abort: {r.spans}"
    assert r.aborted == N_IN_FLIGHT and r.completed == N_QUEUED, r.describe()


def test_wait_returns_after_in_flight_requests_finish_on_the_old_version(served, record_property):
    r = update_under_load(served, "wait", 1, N_IN_FLIGHT, N_QUEUED, max_tokens=SHORT, queued_tokens=QUEUED_TOKENS)
    _check_common(r, record_property)
    assert all(r.engine_done_at_pause.values()), (
        f"/pause?mode=wait returned while requests were still in flight: done={r.engine_done_at_pause}"
    )
    for c in r.in_flight:
        assert c.finish_reason == "length" and len(c.token_ids) == SHORT, (
            f"{c.request_id}: {len(c.token_ids)} tokens, finish {c.finish_reason}: wait must let it finish\n{r.describe()}"
        )
        assert c.versions_seen == {0}, f"{c.request_id} saw versions {c.versions_seen}; wait must finish it on v0"
    assert not r.spans, f"requests span two versions under wait: {r.spans}"


def test_keep_freezes_in_flight_requests_and_continues_them_on_the_new_version(served, record_property):
    r = update_under_load(served, "keep", 1, N_IN_FLIGHT, N_QUEUED, max_tokens=LONG, queued_tokens=QUEUED_TOKENS)
    _check_common(r, record_property)
    assert not any(r.engine_done_at_pause.values()), f"keep must not end requests: {r.engine_done_at_pause}"
    assert r.engine_tokens_before_resume == r.engine_tokens_at_pause, (
        f"frozen requests advanced while paused: at pause {r.engine_tokens_at_pause}, "
        f"after the push {r.engine_tokens_before_resume}"
    )
    for c in r.in_flight:
        frozen = r.engine_tokens_at_pause[c.request_id]
        assert c.finish_reason == "length" and len(c.token_ids) == LONG, f"{c.request_id}: not continued\n{r.describe()}"
        expected = [0] * frozen + [1] * (LONG - frozen)
        assert c.token_versions == expected, (
            f"{c.request_id}: versions {c.token_versions}, expected v0 for the {frozen} tokens before the pause "
            "and v1 after resume"
        )
    assert len(r.spans) == N_IN_FLIGHT, f"every in-flight request should span v0 -> v1 under keep; report: {r.spans}"


def test_abort_requests_by_id_ends_only_those(served):
    streams = start_streams(served.client, 3, 400, "abort-by-id")
    wait_tokens(streams, 1)
    target = streams[0].request.request_id
    assert streams[0].abort() == 1, f"/abort_requests did not find {target}"
    first = streams[0].result(30)
    assert first.finish_reason == "abort", f"{target}: finish {first.finish_reason}, expected abort"
    assert not streams[1].done and not streams[2].done, "aborting one request by id ended others"
    assert served.client.abort_requests() >= 2
    rest = [s.result(30) for s in streams[1:]]
    assert [c.finish_reason for c in rest] == ["abort", "abort"], f"abort-all left {[c.finish_reason for c in rest]}"
    assert not served.client.is_paused(), "/abort_requests must not leave the engine paused"
    after = served.client.complete(request(4, "after-abort"))
    assert after.finish_reason == "length" and len(after.token_ids) == 4, f"engine not serving after abort-all: {after}"


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_requests_sent_while_paused_run_after_resume(served, mode):
    served.client.pause(mode)
    assert served.client.is_paused(), f"/is_paused false after /pause?mode={mode}"
    stream = served.client.submit(request(6, f"paused-{mode}"))
    engine_side = served.server.live_streams()[stream.request.request_id]
    served.client.reset_prefix_cache()  # any round trip: the paused engine must still not have run it
    assert not stream.done and not engine_side.events_after(0, timeout=0), "a request ran while the engine was paused"
    served.client.resume()
    c = stream.result(30)
    assert (c.finish_reason, len(c.token_ids)) == ("length", 6), f"request sent while paused: {c}"
    assert not span_report([c]), span_report([c])
