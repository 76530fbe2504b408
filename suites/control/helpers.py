"""Helpers of the control-plane suite; they carry the docstrings so the tests stay short."""

from __future__ import annotations

import dataclasses
import itertools
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from fixtures.payloads import random_like_spec
from harness.api import Completion, GenerationRequest, RequestStream
from harness.control import routes
from harness.control.client import ControlClient, RemoteStream
from harness.pytest_plugin import NOT_SUPPORTED

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
            lines.append(
                f"{c.request_id}: " + " -> ".join(f"v{v} x{n}" for v, n in runs) + f" ({c.finish_reason})"
            )
    return lines


@dataclasses.dataclass
class UpdateUnderLoad:
    """What happened to streaming requests around one pause -> push -> resume, seen from both ends:
    the client's completions (with per-token versions from the SSE stream) and the engine's streams."""

    mode: str
    max_tokens: int
    queued_tokens: int
    pause_s: float  # how long /pause took to answer
    running_before_pause: dict[str, bool]  # in-flight request id -> still running when /pause was sent
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
            (
                f"mode={self.mode} sent={self.sent} completed={self.completed} aborted={self.aborted} "
                f"/pause answered in {self.pause_s * 1000:.1f} ms"
            )
        ]
        for c in [*self.in_flight, *self.queued]:
            runs = " -> ".join(f"v{v} x{n}" for v, n in version_runs(c.token_versions)) or "no tokens"
            rows.append(f"  {c.request_id}: {runs} finish={c.finish_reason}")
        rows.append(f"  running when /pause was sent: {self.running_before_pause}")
        rows.append(f"  engine tokens when /pause returned: {self.engine_tokens_at_pause}")
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
    streams, engine_streams = [], {}
    for _ in range(n_in_flight):  # the engine-side stream, taken as soon as the server accepted the request
        stream = client.submit(request(max_tokens, f"{mode}-inflight"))
        streams.append(stream)
        engine_streams[stream.request.request_id] = served.server.live_streams()[stream.request.request_id]
    wait_tokens(streams, before)
    running_before_pause = {rid: not es.done for rid, es in engine_streams.items()}
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
    in_flight = [s.result(120) for s in streams]
    queued_results = [s.result(120) for s in queued]
    everything = [*in_flight, *queued_results]
    errors = [f"{s.request.request_id}: {s.error!r}" for s in [*streams, *queued] if s.error is not None]
    assert not errors, f"streams failed on the transport: {errors}"
    return UpdateUnderLoad(
        mode=mode,
        max_tokens=max_tokens,
        queued_tokens=queued_tokens,
        pause_s=pause_s,
        running_before_pause=running_before_pause,
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


# --------------------------------------------------------------------------------------------- pause checks
def assert_nothing_lost(r: UpdateUnderLoad) -> None:
    """What every mode promises: the paused engine ran nothing sent while paused, those requests ran
    after resume entirely on the new version, and every request is counted, by client and server."""
    assert any(r.running_before_pause.values()), (
        f"every request finished before /pause was sent:\n{r.describe()}"
    )
    assert r.queued_tokens_before_resume == {rid: 0 for rid in r.queued_tokens_before_resume}, (
        f"requests sent while paused produced tokens before resume: {r.queued_tokens_before_resume}"
    )
    for c in r.queued:
        assert c.finish_reason == "length" and len(c.token_ids) == r.queued_tokens, (
            f"queued {c.request_id}: {len(c.token_ids)} tokens, finish {c.finish_reason}\n{r.describe()}"
        )
        assert c.versions_seen == {1}, (
            f"queued {c.request_id} ran on versions {c.versions_seen}, expected {{1}}"
        )
    assert r.sent == r.completed + r.aborted == len(r.in_flight) + len(r.queued), (
        f"requests lost:\n{r.describe()}"
    )
    stats = r.server_stats
    assert (stats["submitted"], stats["in_flight"], stats["disconnected"]) == (r.sent, 0, 0), (
        f"server-side accounting {stats} disagrees with the client's sent={r.sent}"
    )
    assert (stats["completed"], stats["aborted"]) == (r.completed, r.aborted), (
        f"server counted {stats}, client counted completed={r.completed} aborted={r.aborted}"
    )


def assert_abort_semantics(r: UpdateUnderLoad) -> None:
    """abort: in-flight requests end at the pause with their partial output, finish_reason abort, all
    on the old version; nothing spans two versions."""
    assert_nothing_lost(r)
    assert all(r.running_before_pause.values()), f"requests finished before /pause was sent:\n{r.describe()}"
    assert all(r.engine_done_at_pause.values()), (
        f"in-flight requests still running after /pause?mode=abort: {r.engine_done_at_pause}"
    )
    for c in r.in_flight:
        assert c.finish_reason == "abort", (
            f"{c.request_id}: finish {c.finish_reason}, expected abort\n{r.describe()}"
        )
        assert 1 <= len(c.token_ids) < r.max_tokens, (
            f"{c.request_id}: {len(c.token_ids)} tokens is not a partial output"
        )
        assert len(c.token_ids) == r.engine_tokens_at_pause[c.request_id], (
            f"{c.request_id}: client got {len(c.token_ids)} tokens, engine produced {r.engine_tokens_at_pause[c.request_id]}"
        )
    assert not r.spans, f"requests span two versions under abort: {r.spans}"
    assert (r.aborted, r.completed) == (len(r.in_flight), len(r.queued)), r.describe()


def assert_wait_semantics(r: UpdateUnderLoad) -> None:
    """wait: /pause answers only once in-flight requests finished, whole, on the old version."""
    assert_nothing_lost(r)
    assert all(r.engine_done_at_pause.values()), (
        f"/pause?mode=wait returned while requests were still in flight: done={r.engine_done_at_pause}"
    )
    for c in r.in_flight:
        assert c.finish_reason == "length" and len(c.token_ids) == r.max_tokens, (
            f"{c.request_id}: {len(c.token_ids)} tokens, finish {c.finish_reason}: wait must let it finish\n{r.describe()}"
        )
        assert c.versions_seen == {0}, (
            f"{c.request_id} saw versions {c.versions_seen}; wait must finish it on v0"
        )
    assert not r.spans, f"requests span two versions under wait: {r.spans}"


def assert_keep_semantics(r: UpdateUnderLoad) -> None:
    """keep: in-flight requests freeze (no token while paused), then continue on the new version: v0
    for the tokens before the pause, v1 after; every one of them spans the two versions."""
    assert_nothing_lost(r)
    assert all(r.running_before_pause.values()), f"requests finished before /pause was sent:\n{r.describe()}"
    assert not any(r.engine_done_at_pause.values()), f"keep must not end requests: {r.engine_done_at_pause}"
    assert r.engine_tokens_before_resume == r.engine_tokens_at_pause, (
        f"frozen requests advanced while paused: at pause {r.engine_tokens_at_pause}, "
        f"after the push {r.engine_tokens_before_resume}"
    )
    for c in r.in_flight:
        frozen = r.engine_tokens_at_pause[c.request_id]
        assert c.finish_reason == "length" and len(c.token_ids) == r.max_tokens, (
            f"{c.request_id}: not continued\n{r.describe()}"
        )
        expected = [0] * frozen + [1] * (r.max_tokens - frozen)
        assert c.token_versions == expected, (
            f"{c.request_id}: versions {version_runs(c.token_versions)}, expected v0 x{frozen} (before the pause) "
            f"then v1 x{r.max_tokens - frozen}"
        )
    assert len(r.spans) == len(r.in_flight), (
        f"every in-flight request should span v0 -> v1 under keep; report: {r.spans}"
    )


PAUSE_SEMANTICS = {
    "abort": assert_abort_semantics,
    "wait": assert_wait_semantics,
    "keep": assert_keep_semantics,
}


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


def start_cli(
    args: Sequence[str], env: dict[str, str], workdir: Path, **popen: Any
) -> tuple[subprocess.Popen, list[str], str, Path]:
    """`python -m harness.control.app --allowed-dir workdir *args`, its output in a file (a pipe nobody
    drains once the server is up would stall its logging). Returns the process, the lines it printed
    up to `listening on URL`, the URL, and the log's path."""
    log = workdir / f"cli-{next(_ids)}.log"
    cmd = [sys.executable, "-m", "harness.control.app", "--allowed-dir", str(workdir), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, **popen)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        lines = log.read_text().splitlines()
        said = [line for line in lines if "listening on" in line]
        if said:  # printed once the socket is bound
            return proc, lines, said[0].rsplit(" ", 1)[-1], log
        select.select([], [], [], 0.05)
    proc.kill()
    proc.wait(30)
    raise AssertionError(f"CLI exited {proc.returncode} without listening: {log.read_text()[-800:]}")


def clean_env() -> dict[str, str]:
    """This process's environment without a control token: a CLI started with it runs without auth."""
    return {k: v for k, v in os.environ.items() if k not in ("WEIGHTSYNC_CONTROL_TOKEN", "VLLM_API_KEY")}


def beyond_vllm(method: str, path: str) -> bool:
    """A route of the harness server's own (its table marks it vllm=False): not vLLM's API."""
    found = routes.find(method, path)
    return found is not None and not found.vllm


def require_route(served, method: str, path: str) -> None:
    """Against a foreign server, a route beyond vLLM's API is NOT_SUPPORTED: no foreign server is asked
    for the harness server's own routes (/weight_status, /weight_spec, /stats, /abort_weight_update)."""
    if served.foreign is not None and beyond_vllm(method, path):
        pytest.skip(f"{NOT_SUPPORTED}: {method} {path} is the harness server's own route, beyond vLLM's API")


def require_text_prompts(served) -> None:
    """A foreign server's object says `text_prompts = False` when it serves no tokenizer (a model without
    one): a test that sends text is NOT_SUPPORTED there."""
    if served.foreign is not None and not getattr(served.foreign, "text_prompts", True):
        pytest.skip(f"{NOT_SUPPORTED}: the server under test serves no tokenizer: text prompts are refused")
