"""Helpers of the control-plane suite; they carry the docstrings so the tests stay short."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Sequence

import httpx
import torch

from fixtures.payloads import random_like_spec
from harness.api import Completion, GenerationRequest, RequestStream
from harness.control.client import ControlClient, RemoteStream

_ids = itertools.count()


def weights_for(engine, seed: int) -> dict[str, torch.Tensor]:
    """Seeded finite weights for every tensor the engine holds."""
    return random_like_spec(engine.weight_spec(), seed=seed)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose raw bits differ (or that are missing), compared as same-width integers: exact for
    NaN payloads and -0.0, and ten times faster than a byte-wise compare (the fuzz test runs it per request)."""
    out = []
    for name, e in expected.items():
        g = got.get(name)
        if g is None or g.dtype != e.dtype or g.shape != e.shape:
            out.append(name)
            continue
        as_int = _SAME_WIDTH_INT[e.element_size()]
        if not torch.equal(e.contiguous().view(as_int), g.contiguous().view(as_int)):
            out.append(name)
    return out


def request(max_tokens: int, tag: str = "r", prompt_len: int = 5) -> GenerationRequest:
    """A greedy request with a prompt of its own (distinct requests do not share a prefix)."""
    i = next(_ids)
    prompt = tuple((7 * i + 13 * j + 1) % 250 for j in range(prompt_len))
    return GenerationRequest(f"{tag}-{i}", prompt, max_tokens)


def start_streams(client: ControlClient, n: int, max_tokens: int, tag: str) -> list[RemoteStream]:
    """n streaming completions, each accepted by the server before this returns."""
    return [client.submit(request(max_tokens, tag)) for _ in range(n)]


def wait_tokens(streams: Sequence[RequestStream], n: int, timeout: float = 60.0) -> None:
    """Block until every stream delivered n tokens (or finished); fail naming the laggards."""
    late = [s.request.request_id for s in streams if not s.wait_for_tokens(n, timeout)]
    assert not late, f"streams {late} did not deliver {n} tokens within {timeout}s"


def engine_tokens(stream: RequestStream) -> int:
    """Tokens an engine-side stream has produced so far (exact: read under the stream's lock)."""
    return sum(e.token_id is not None for e in stream.events_after(0, timeout=0))


def version_runs(versions: Iterable[int]) -> list[tuple[int, int]]:
    """[(version, how many consecutive tokens)] of one request: [(0, 12), (1, 36)] spans two versions."""
    return [(v, len(list(g))) for v, g in itertools.groupby(versions)]


def span_report(completions: Iterable[Completion]) -> list[str]:
    """One line per request whose tokens came from more than one weight version."""
    lines = []
    for c in completions:
        runs = version_runs(c.token_versions)
        if len(runs) > 1:
            lines.append(f"{c.request_id}: " + " -> ".join(f"v{v} x{n}" for v, n in runs) + f" ({c.finish_reason})")
    return lines


@dataclasses.dataclass
class UpdateUnderLoad:
    """What happened to streaming requests around one pause -> push -> resume, seen from both ends:
    the client's completions (with per-token versions from the SSE stream) and the engine's streams."""

    mode: str
    max_tokens: int
    queued_tokens: int
    pause_s: float  # how long /pause took to answer
    in_flight: list[Completion]
    queued: list[Completion]  # sent while paused
    engine_done_at_pause: dict[str, bool]  # in-flight request id -> finished when /pause returned
    engine_tokens_at_pause: dict[str, int]
    engine_tokens_before_resume: dict[str, int]  # after the push, still paused
    queued_tokens_before_resume: dict[str, int]
    sent: int
    completed: int
    aborted: int
    server_stats: dict

    @property
    def spans(self) -> list[str]:
        return span_report([*self.in_flight, *self.queued])

    def describe(self) -> str:
        rows = [
            f"mode={self.mode} sent={self.sent} completed={self.completed} aborted={self.aborted} "
            f"/pause answered in {self.pause_s * 1000:.1f} ms"
        ]
        for c in [*self.in_flight, *self.queued]:
            runs = " -> ".join(f"v{v} x{n}" for v, n in version_runs(c.token_versions)) or "no tokens"
            rows.append(f"  {c.request_id}: {runs} finish={c.finish_reason}")
        rows.append(f"  server stats: {self.server_stats}")
        return "\n".join(rows)


def update_under_load(
    served,
    mode: str,
    version: int,
    n_in_flight: int = 4,
    n_queued: int = 2,
    max_tokens: int = 48,
    queued_tokens: int = 8,
    before: int = 2,
) -> UpdateUnderLoad:
    """Stream n_in_flight requests; once each delivered `before` tokens, pause(mode), send n_queued more
    (they must wait), push `version` over HTTP, resume, and collect everything.

    `max_tokens` must outlast the pause call: the reference engine's scheduler re-takes its lock after
    every step, so pause() has been measured to wait up to ~250 ms for it while requests run."""
    client = served.client
    streams = start_streams(client, n_in_flight, max_tokens, f"{mode}-inflight")
    wait_tokens(streams, before)
    live = served.server.live_streams()
    engine_streams = {s.request.request_id: live[s.request.request_id] for s in streams if s.request.request_id in live}
    started = time.monotonic()
    client.pause(mode)
    pause_s = time.monotonic() - started
    done_at_pause = {rid: es.done for rid, es in engine_streams.items()}
    tokens_at_pause = {rid: engine_tokens(es) for rid, es in engine_streams.items()}
    queued = start_streams(client, n_queued, queued_tokens, f"{mode}-queued")
    queued_engine = {s.request.request_id: served.server.live_streams()[s.request.request_id] for s in queued}
    served.push(version, weights_for(served.engine, seed=version))
    tokens_before_resume = {rid: engine_tokens(es) for rid, es in engine_streams.items()}
    queued_before_resume = {rid: engine_tokens(es) for rid, es in queued_engine.items()}
    client.resume()
    in_flight = [s.result(60) for s in streams]
    queued_results = [s.result(60) for s in queued]
    everything = [*in_flight, *queued_results]
    errors = [f"{s.request.request_id}: {s.error!r}" for s in [*streams, *queued] if s.error is not None]
    assert not errors, f"streams failed on the transport: {errors}"
    return UpdateUnderLoad(
        mode=mode,
        max_tokens=max_tokens,
        queued_tokens=queued_tokens,
        pause_s=pause_s,
        in_flight=in_flight,
        queued=queued_results,
        engine_done_at_pause=done_at_pause,
        engine_tokens_at_pause=tokens_at_pause,
        engine_tokens_before_resume=tokens_before_resume,
        queued_tokens_before_resume=queued_before_resume,
        sent=len(everything),
        completed=sum(c.finish_reason in ("length", "stop") for c in everything),
        aborted=sum(c.finish_reason == "abort" for c in everything),
        server_stats=client.stats(),
    )


class LoseAnswers(httpx.BaseTransport):
    """A transport that, for the first `n` requests to `path`, either delivers the request and drops the
    server's answer (mode 'answer': the client sees a ReadTimeout although the server ran it), or drops
    the request itself (mode 'request': a ConnectError, the server never sees it)."""

    def __init__(self, path: str, n: int = 1, mode: str = "answer"):
        self.path, self.remaining, self.mode = path, n, mode
        self._inner = httpx.HTTPTransport()

    def handle_request(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == self.path and self.remaining > 0:
            self.remaining -= 1
            if self.mode == "request":
                raise httpx.ConnectError("injected: connection refused", request=req)
            resp = self._inner.handle_request(req)
            resp.read()
            resp.close()
            raise httpx.ReadTimeout("injected: the answer was lost", request=req)
        return self._inner.handle_request(req)

    def close(self) -> None:
        self._inner.close()
