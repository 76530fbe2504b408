"""Generation over HTTP: /v1/completions (JSON or SSE, each token stamped with its weight version) and
/abort_requests, as a part of ControlServer.

Prompts are token ids or, for an engine with a `tokenizer`, text; answers carry the decoded text
(`harness.control.text`), vLLM's logprobs object when asked, and usage with
`prompt_tokens_details.cached_tokens` (the prompt tokens the engine's prefix cache served).

No thread per request: the engine's stream hands each event to the event loop as it is pushed
(`RequestStream.subscribe`); a stream without that hook is polled in short slices by a bounded pool
(`ServerConfig.stream_threads`). The SSE generator sends the events as `data:` lines only, as vLLM does
(its clients assert every line is one); `ServerConfig.keepalive_s` adds a comment while a stream is
idle, for proxies that cut idle connections."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from harness.api import GenerationRequest, TokenEvent
from harness.control import schemas
from harness.control.errors import ApiError, invalid
from harness.control.text import MAX_LOGPROBS, TextOut

PUMP_SLICE_S = 0.05  # how long a pooled pump waits on one stream before serving the next


@dataclasses.dataclass
class Live:
    """One /v1/completions request: the engine's stream, and the queue its pump thread fills."""

    request_id: str
    stream: Any  # RequestStream
    queue: asyncio.Queue
    created: int
    closed: bool = False
    outcome: str | None = None  # length | stop | abort | disconnected
    tokens: int = 0
    text: TextOut = dataclasses.field(default_factory=lambda: TextOut(None))


class Completions:
    """ControlServer's generation routes. Uses the server's engine, config, counters, `_live` (in-flight
    requests by id), `_closing`, `_loop`, `_in_thread`, `_query_pool` and `_stream_pool`."""

    def _forward(self, live: Live, loop: asyncio.AbstractEventLoop) -> Callable[[list[TokenEvent]], None]:
        """A stream listener: hands the engine's events for one request to the event loop."""

        def deliver(events: list[TokenEvent]) -> None:
            if live.closed or self._closing:
                return
            try:
                loop.call_soon_threadsafe(live.queue.put_nowait, events)
            except RuntimeError:  # the loop is closed: the server stopped
                pass

        return deliver

    def _pump_slice(self, live: Live, deliver: Callable[[list[TokenEvent]], None], i: int) -> None:
        """For a stream without `subscribe`: forward what arrived within one short wait, then give the
        pool's thread to the next stream (requeued behind it) until this one finishes."""
        if live.closed or self._closing:
            return
        events = live.stream.events_after(i, timeout=PUMP_SLICE_S)
        if events:
            deliver(events)
            if events[-1].finish_reason is not None:
                return
        try:
            self._stream_pool.submit(self._pump_slice, live, deliver, i + len(events))
        except RuntimeError:  # the pool shut down: the server stopped
            pass

    def _chunk(self, live: Live, events: list[TokenEvent], finish: str | None) -> dict[str, Any]:
        tokens = [e for e in events if e.token_id is not None]
        ids = [e.token_id for e in tokens]
        return {
            "id": live.request_id,
            "object": "text_completion",
            "created": live.created,
            "model": self.config.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": live.text.piece(ids, final=finish is not None),
                    "logprobs": live.text.object(tokens),
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": ids,
                    "token_weight_versions": [e.weight_version for e in tokens],  # weightsync extension
                }
            ],
        }

    def _usage(self, live: Live) -> dict[str, Any]:
        n_prompt = len(live.stream.request.prompt_token_ids)
        usage: dict[str, Any] = {
            "prompt_tokens": n_prompt,
            "completion_tokens": live.tokens,
            "total_tokens": n_prompt + live.tokens,
        }
        # vLLM adds it under --enable-prompt-tokens-details; we always do, when the engine says
        cached = getattr(live.stream, "num_cached_tokens", None)
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _prompt_ids(self, body: schemas.CompletionBody) -> tuple[int, ...]:
        """The prompt as token ids: as sent, or a string (alone or in a one-element list) encoded by
        the engine's tokenizer; refused as vLLM refuses it (400 naming `prompt`)."""
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return tuple(prompt)  # type: ignore[arg-type]
        text = prompt if isinstance(prompt, str) else prompt[0]
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            raise invalid(
                f"{type(self.engine).__name__} has no tokenizer: send the prompt as token ids", "prompt"
            )
        ids = tuple(tokenizer.encode(text))  # type: ignore[arg-type]
        if not ids:
            raise invalid("the prompt encodes to no tokens", "prompt")
        if len(ids) > schemas.MAX_PROMPT_TOKENS:
            raise invalid(f"the prompt is {len(ids)} tokens, more than {schemas.MAX_PROMPT_TOKENS}", "prompt")
        return ids

    def _logprobs(self, body: schemas.CompletionBody) -> int | None:
        """The request's `logprobs`, refused as vLLM refuses it (400 naming `logprobs`)."""
        n = body.logprobs
        if n is None:
            return None
        if n < 0 and n != -1:
            raise invalid("`logprobs` must be a positive value or -1.", "logprobs")
        if n == -1 or n > MAX_LOGPROBS:  # -1: the whole vocabulary
            asked = "the whole vocabulary" if n == -1 else n
            raise invalid(
                f"Requested sample logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS}",
                "logprobs",
            )
        if not getattr(self.engine, "reports_logprobs", False):
            raise invalid(f"{type(self.engine).__name__} does not report log-probabilities", "logprobs")
        return n

    def _settle(self, live: Live, outcome: str) -> None:
        if live.outcome is None:
            live.outcome = outcome
            live.closed = True
            self.counters["completed" if outcome in ("length", "stop") else outcome] += 1
            self._live.pop(live.request_id, None)

    async def _events(self, live: Live):
        """(events, finish_reason) batches of one request, with None batches as keepalive ticks."""
        while True:
            try:
                events = await asyncio.wait_for(live.queue.get(), self.config.keepalive_s)
            except asyncio.TimeoutError:
                yield None, None
                continue
            finish = events[-1].finish_reason
            live.tokens += sum(e.token_id is not None for e in events)
            if finish is not None:
                self._settle(live, finish)  # counted before the client can see the final chunk
            yield events, finish
            if finish is not None:
                return

    async def _submit(self, body: schemas.CompletionBody) -> Live:
        if body.model not in (None, self.config.model_name):
            raise ApiError(404, "NotFoundError", f"The model `{body.model[:100]}` does not exist.")
        prompt, logprobs = self._prompt_ids(body), self._logprobs(body)
        if self._closing:
            raise ApiError(503, "ServiceUnavailable", "the server is shutting down")
        if len(self._live) >= self.config.max_inflight_requests:
            raise ApiError(
                429,
                "TooManyRequests",
                f"{len(self._live)} requests in flight (limit {self.config.max_inflight_requests})",
            )
        rid = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        if rid in self._live:
            raise ApiError(409, "DuplicateRequestId", f"request id {rid!r} is already in flight")
        req = GenerationRequest(
            rid, prompt, body.max_tokens or 16, tuple(body.stop_token_ids or ()), logprobs=logprobs
        )
        stream = await self._in_thread(lambda: self.engine.submit(req), self._query_pool)
        self._loop = asyncio.get_running_loop()
        text = TextOut(getattr(self.engine, "tokenizer", None), logprobs)
        live = Live(rid, stream, asyncio.Queue(), int(time.time()), text=text)
        self._live[rid] = live
        self.counters["submitted"] += 1
        deliver = self._forward(live, self._loop)
        subscribe = getattr(stream, "subscribe", None)
        if callable(subscribe):  # no thread: the engine's own thread hands each event to the loop
            subscribe(deliver)
        else:
            self._stream_pool.submit(self._pump_slice, live, deliver, 0)
        return live

    async def on_completions(self, request: Request, query: dict[str, Any], body: schemas.CompletionBody):
        """POST /v1/completions: token ids or text in; text, token ids and (when asked) logprobs out,
        each token stamped with its weight version."""
        live = await self._submit(body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if not body.stream:
            tokens: list[TokenEvent] = []
            finish = None
            try:
                async for events, finish in self._events(live):  # noqa: B007 - the last one is read after
                    tokens.extend(events or ())
            finally:
                self._settle(live, finish or "disconnected")
            chunk = self._chunk(live, tokens, finish)
            chunk["usage"] = self._usage(live)
            return JSONResponse(chunk)

        async def sse():
            finish = None
            try:
                async for events, finish in self._events(live):
                    if events is None:
                        yield b": keepalive\n\n"
                        continue
                    yield b"data: " + json.dumps(self._chunk(live, events, finish)).encode() + b"\n\n"
                if include_usage:
                    usage = {**self._chunk(live, [], None), "choices": [], "usage": self._usage(live)}
                    yield b"data: " + json.dumps(usage).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                self._settle(live, finish or "disconnected")

        return StreamingResponse(
            sse(),
            media_type="text/event-stream",
            headers={"x-request-id": live.request_id, "cache-control": "no-cache"},
        )

    async def on_abort_requests(
        self, request: Request, query: dict[str, Any], body: schemas.AbortRequestsBody
    ) -> dict[str, Any]:
        if not body.request_ids:
            n = await self._in_thread(self._abort_all)
            return {"status": "aborted", "aborted": n}
        engine_abort = getattr(self.engine, "abort_requests", None)
        # counted before the engine acts: its abort event may close the stream before the loop below
        found = [
            self._live[r]
            for r in dict.fromkeys(body.request_ids)
            if r in self._live and not self._live[r].closed
        ]
        if callable(engine_abort):
            await self._in_thread(lambda: engine_abort([live.request_id for live in found]))
        for live in found:
            if live.closed:
                continue
            # The stream ends here with finish_reason abort; without an engine-side abort the engine
            # still finishes the request (bounded by max_tokens) and its tokens are dropped.
            version = self.engine.weight_version
            live.queue.put_nowait([TokenEvent(live.request_id, live.tokens, None, version, "abort")])
            live.closed = True
        return {"status": "aborted", "aborted": len(found)}
