"""Pause/resume over HTTP with streaming requests in flight while a version is pushed, per pause mode.

Each token carries the weight version that produced it (the SSE stream's `token_weight_versions`);
a request spanning two versions is reported: expected under keep, a failure under abort and wait.
Nothing is lost: every request sent is counted as completed or aborted, by the client and the server.
"""

from __future__ import annotations

import pytest

from suites.control.helpers import (
    assert_abort_semantics,
    assert_keep_semantics,
    assert_wait_semantics,
    request,
    span_report,
    start_streams,
    update_under_load,
    wait_tokens,
)

N_IN_FLIGHT, N_QUEUED, QUEUED_TOKENS = 4, 2, 8
LONG = 256  # in-flight requests that must still be running when the pause lands (abort, keep)
SHORT = 64  # in-flight requests under wait, which the pause lets finish


def _run(served, mode: str, max_tokens: int, record_property):
    r = update_under_load(
        served, mode, 1, N_IN_FLIGHT, N_QUEUED, max_tokens=max_tokens, queued_tokens=QUEUED_TOKENS
    )
    record_property("version_spans", r.spans)
    print(r.describe())
    return r


def test_abort_ends_in_flight_requests_with_partial_output(served, record_property):
    assert_abort_semantics(_run(served, "abort", LONG, record_property))


def test_wait_returns_after_in_flight_requests_finish_on_the_old_version(served, record_property):
    assert_wait_semantics(_run(served, "wait", SHORT, record_property))


def test_keep_freezes_in_flight_requests_and_continues_them_on_the_new_version(served, record_property):
    assert_keep_semantics(_run(served, "keep", LONG, record_property))


def test_abort_requests_by_id_ends_only_those(served):
    streams = start_streams(
        served.client, 3, 2000, "abort-by-id"
    )  # long enough to outlive the abort on a fast engine
    wait_tokens(streams, 1)
    target = streams[0].request.request_id
    assert streams[0].abort() == 1, f"/abort_requests did not find {target}"
    first = streams[0].result(30)
    assert first.finish_reason == "abort", f"{target}: finish {first.finish_reason}, expected abort"
    assert not streams[1].done and not streams[2].done, "aborting one request by id ended others"
    assert served.client.abort_requests() >= 2
    rest = [s.result(30) for s in streams[1:]]
    assert [c.finish_reason for c in rest] == ["abort", "abort"], (
        f"abort-all left {[c.finish_reason for c in rest]}"
    )
    assert not served.client.is_paused(), "/abort_requests must not leave the engine paused"
    after = served.client.complete(request(4, "after-abort"))
    assert after.finish_reason == "length" and len(after.token_ids) == 4, (
        f"engine not serving after abort-all: {after}"
    )


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_requests_sent_while_paused_run_after_resume(served, mode):
    served.client.pause(mode)
    assert served.client.is_paused(), f"/is_paused false after /pause?mode={mode}"
    stream = served.client.submit(request(6, f"paused-{mode}"))
    engine_side = served.server.live_streams()[stream.request.request_id]
    served.client.reset_prefix_cache()  # any round trip: the paused engine must still not have run it
    assert not stream.done and not engine_side.events_after(0, timeout=0), (
        "a request ran while the engine was paused"
    )
    served.client.resume()
    c = stream.result(30)
    assert (c.finish_reason, len(c.token_ids)) == ("length", 6), f"request sent while paused: {c}"
    assert not span_report([c]), span_report([c])
