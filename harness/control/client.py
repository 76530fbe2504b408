"""An httpx client for vLLM's dev-mode routes, for this harness's control server and for real vLLM.

Bodies are vLLM's: `{"init_info": ...}`, `{"update_info": ...}`, `{"weight_version": "<str>"}`, query
parameters on /pause. Everything the harness adds is optional on the wire and detected, not assumed.

Retries never apply an update twice:
- a request that never reached the server (connect error, no pooled connection) is always retried;
- a request whose outcome is unknown (timeout or broken connection after sending) is retried only when
  repeating it is harmless: reads, pause/resume, version labels; or when the server de-duplicates by
  `Idempotency-Key` (this harness's server says so in /weight_status); each logical call sends one key;
- `finish_weight_update(v)` is recognised rather than re-applied: after an unknown outcome or a refusal,
  the client reads /weight_status (/weight_info on vLLM), and a server already serving v means the
  finish landed;
- anything else with an unknown outcome raises `AmbiguousResultError`: unknown is never reported as ok.

Why one file: the retry rules above hold for every call; one class applies them to every route, and splitting
the routes would split the rules.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from harness.api import (
    JSON,
    Completion,
    GenerationRequest,
    RequestStream,
    TokenEvent,
    TransferError,
    WeightSyncError,
)
from harness.control import routes
from harness.error_codec import from_http, http_type_and_message

UNKNOWN_VERSION = -1  # TokenEvent.weight_version when the server does not report it (vLLM)


# --------------------------------------------------------------------------------------------- errors
class ControlHTTPError(WeightSyncError):
    """The server answered with an error that maps to no harness error."""

    def __init__(self, message: str, status: int, type_: str = ""):
        super().__init__(message)
        self.status = status
        self.type = type_


class AmbiguousResultError(TransferError):
    """A mutating call whose outcome is unknown (no answer came) and that is not safe to repeat."""


def error_from_response(resp: httpx.Response) -> WeightSyncError:
    """The harness error a response stands for (harness.error_codec.from_http); ControlHTTPError where it
    names none."""
    try:
        body = resp.json()
    except ValueError:
        body = resp.text[:500]
    where = f"[HTTP {resp.status_code} from {resp.request.method} {resp.request.url.path}]"
    exc = from_http(resp.status_code, body, where)
    if exc is not None:
        return exc
    type_, message = http_type_and_message(body)
    return ControlHTTPError(f"{type_ + ': ' if type_ else ''}{message} {where}", resp.status_code, type_)


# --------------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds. `pause` covers /pause?mode=wait, which returns only once in-flight requests finished;
    `update` covers update_weights, which waits for the data plane."""

    connect: float = 5.0
    control: float = 60.0
    pause: float = 600.0
    update: float = 600.0
    stream_idle: float = 600.0  # longest gap between two chunks of a stream (a paused request is idle)
    write: float = 60.0


_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


# --------------------------------------------------------------------------------------------- client
class ControlClient:
    """The four-phase weight-update API and the control routes, over HTTP."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeouts: Timeouts = Timeouts(),
        retries: int = 3,
        backoff_s: float = 0.05,
        model: str | None = None,
        idempotency_keys: bool | None = None,  # None: use them when the server says it honours them
        transport: httpx.BaseTransport | None = None,
        retry_timeouts: bool = True,  # False: a call that timed out is not repeated (a supervisor kills the server)
    ):
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self.retries = retries
        self.retry_timeouts = retry_timeouts
        self._transport = transport
        self.backoff_s = backoff_s
        self.model = model
        self._keys = idempotency_keys
        self._kind: str | None = None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = self._new_http()
        self.attempts: list[
            tuple[str, str]
        ] = []  # (path, outcome) of every attempt: what the retry tests read

    def _new_http(self) -> httpx.Client:
        timeouts = self.timeouts
        return httpx.Client(
            base_url=self.base_url,
            transport=self._transport,
            # below uvicorn's 5 s keep-alive (vLLM's default too): a pooled connection the server
            # already closed would make a sent request look lost
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64, keepalive_expiry=2.0),
            timeout=httpx.Timeout(timeouts.control, connect=timeouts.connect, write=timeouts.write),
        )

    def reroute(self, base_url: str) -> None:
        """Talk to the same server at another address from now on (a relay in between, or no longer):
        pooled connections to the old address are closed."""
        self._http.close()
        self.base_url = base_url.rstrip("/")
        self._http = self._new_http()

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, read: float) -> httpx.Timeout:
        t = self.timeouts
        return httpx.Timeout(read, connect=t.connect, write=t.write, pool=t.connect)

    def _probe(self) -> None:
        info = self.weight_status()
        self._kind = "weightsync" if info.get("server") == "weightsync" else "vllm"
        if self._keys is None:
            self._keys = info.get("idempotency_keys") is True

    def server_kind(self) -> str:
        """'weightsync' (this harness's server) or 'vllm' (anything that does not say it is ours)."""
        if self._kind is None:
            self._probe()
        return self._kind  # type: ignore[return-value]

    def uses_idempotency_keys(self) -> bool:
        if self._keys is None:
            self._probe()
        return bool(self._keys)

    def _call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        read_timeout: float | None = None,
        repeatable: bool = False,
        keyed: bool = False,
    ) -> httpx.Response:
        """One logical call with retries. `repeatable`: running it twice is harmless. `keyed`: send one
        Idempotency-Key for all attempts, and retry unknown outcomes if the server de-duplicates. A call
        the route table lacks (`harness.control.routes.ROUTES`) is a ValueError, never sent."""
        routes.check_call(method, path, params or ())
        headers = dict(self._headers)
        dedupes = False
        if keyed and self.uses_idempotency_keys():
            headers["Idempotency-Key"] = f"ws-{uuid.uuid4().hex}"
            dedupes = True
        timeout = self._timeout(read_timeout or self.timeouts.control)
        kwargs: dict[str, Any] = {"headers": headers, "params": params, "timeout": timeout}
        if json_body is not None:
            kwargs["json"] = json_body
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = self._http.request(method, path, **kwargs)
            except _NOT_SENT as exc:
                self.attempts.append((path, f"not sent: {type(exc).__name__}"))
                timed_out = isinstance(exc, httpx.TimeoutException) and not self.retry_timeouts
                if attempt > self.retries or timed_out:
                    raise TransferError(
                        f"{method} {self.base_url}{path}: no connection after {attempt} attempts: {exc!r}"
                    ) from exc
            except httpx.TransportError as exc:
                self.attempts.append((path, f"unknown: {type(exc).__name__}"))
                timed_out = isinstance(exc, httpx.TimeoutException) and not self.retry_timeouts
                if not (repeatable or dedupes) or attempt > self.retries or timed_out:
                    raise AmbiguousResultError(
                        f"{method} {self.base_url}{path}: no answer ({exc!r}) after {attempt} attempt(s); the server "
                        "may or may not have applied it, and repeating it is not known to be safe"
                    ) from exc
            else:
                self.attempts.append((path, str(resp.status_code)))
                if resp.status_code == 503 and (repeatable or dedupes) and attempt <= self.retries:
                    pass  # unavailable: nothing was applied
                elif resp.status_code >= 400:
                    raise error_from_response(resp)
                else:
                    return resp
            time.sleep(self.backoff_s * (2 ** (attempt - 1)))  # backoff between attempts, not synchronisation

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        if not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError:
            return {"text": resp.text[:500]}

    def _call_json(self, method: str, path: str, **options: Any) -> Any:
        """`_call`'s answer read as JSON (`_json`)."""
        return self._json(self._call(method, path, **options))

    # ------------------------------------------------------------------ four phases
    def init_weight_transfer_engine(self, init_info: JSON) -> JSON:
        return self._call_json(
            "POST", "/init_weight_transfer_engine", json_body={"init_info": init_info}, keyed=True
        )

    def start_weight_update(self) -> JSON:
        return self._call_json("POST", "/start_weight_update", keyed=True)

    def update_weights(self, update_info: JSON) -> JSON:
        return self._call_json(
            "POST",
            "/update_weights",
            json_body={"update_info": update_info},
            read_timeout=self.timeouts.update,
            keyed=True,
        )

    def finish_weight_update(self, version: int | str | None) -> JSON:
        """Commit `version`. Idempotent per version: when the first answer is lost or a retry is
        refused, a server that already serves `version` means the finish landed (once)."""
        body = {"weight_version": str(version)} if version is not None else None
        try:
            return self._call_json("POST", "/finish_weight_update", json_body=body, keyed=True)
        except (AmbiguousResultError, WeightSyncError) as exc:
            if version is None or not self._serves(version):
                if isinstance(exc, AmbiguousResultError) and version is not None:
                    return self._finish_again(version, body, exc)
                raise
            return self._already_committed(version)

    def _finish_again(self, version: int | str, body: JSON, first: Exception) -> JSON:
        """The first finish's outcome is unknown and the server does not serve `version` yet: repeat it.
        Safe without de-duplication: one update can be finished once, so a repeat either commits it (the
        first never ran) or is refused (it did), and the refusal is resolved by reading the version."""
        for _ in range(self.retries):
            try:
                return self._call_json("POST", "/finish_weight_update", json_body=body, keyed=True)
            except (AmbiguousResultError, WeightSyncError) as exc:
                if self._serves(version):
                    return self._already_committed(version)
                if not isinstance(exc, AmbiguousResultError):
                    raise
        raise first

    def _already_committed(self, version: int | str) -> JSON:
        """A finish answered by reading the server: it already serves `version`, so the finish landed once."""
        self.attempts.append(("/finish_weight_update", "recognised: already committed"))
        return {
            "message": "Weight update finished",
            "weight_version": str(version),
            "already_committed": True,
        }

    def _serves(self, version: int | str) -> bool:
        info = self.weight_status()
        return str(info.get("weight_version")) == str(version) or info.get("engine_version") == version

    def abort_weight_update(self) -> bool:
        """Discard the staged update (this harness's server; vLLM has no such route: False)."""
        try:
            self._call("POST", "/abort_weight_update", keyed=True)
        except ControlHTTPError as exc:
            if exc.status in (404, 405):
                return False
            raise
        return True

    # ------------------------------------------------------------------ control routes
    def pause(self, mode: str = "abort", clear_cache: bool | None = None) -> JSON:
        params = {"mode": mode}
        if clear_cache is not None:
            params["clear_cache"] = "true" if clear_cache else "false"
        return self._call_json(
            "POST", "/pause", params=params, read_timeout=self.timeouts.pause, repeatable=True, keyed=True
        )

    def resume(self) -> JSON:
        return self._call_json("POST", "/resume", repeatable=True, keyed=True)

    def is_paused(self) -> bool:
        return bool(self._call_json("GET", "/is_paused", repeatable=True)["is_paused"])

    def abort_requests(self, request_ids: Sequence[str] | None = None) -> int:
        # always a JSON object: vLLM's /abort_requests refuses a request without a body (400 "Invalid
        # JSON format"); an object without ids aborts everything in flight
        body = {"request_ids": list(request_ids)} if request_ids else {}
        return int(
            self._call_json("POST", "/abort_requests", json_body=body, repeatable=True).get("aborted", 0)
        )

    def weight_info(self) -> JSON:
        return self._call_json("GET", "/weight_info", repeatable=True)

    def weight_status(self) -> JSON:
        """/weight_status on this harness's server (the engine version, an open update, the server's
        name); /weight_info on a server without it (vLLM answers 404)."""
        if self._kind != "vllm":
            try:
                return self._call_json("GET", "/weight_status", repeatable=True)
            except ControlHTTPError as exc:
                if exc.status not in (404, 405):
                    raise
                self._kind = "vllm"
        return self.weight_info()

    def weight_version(self) -> str | None:
        return self.weight_info().get("weight_version")

    def update_weight_version(self, new_version: str) -> JSON:
        return self._call_json(
            "POST",
            "/update_weight_version",
            json_body={"new_version": new_version},
            repeatable=True,
            keyed=True,
        )

    def reset_prefix_cache(self) -> bool:
        """False when the server says it could not (vLLM 0.32: blocks still held by running requests)."""
        return (
            self._call_json("POST", "/reset_prefix_cache", repeatable=True, keyed=True).get("success", True)
            is not False
        )

    def weight_spec(self) -> JSON:
        return self._call_json("GET", "/weight_spec", repeatable=True)

    def stats(self) -> JSON:
        return self._call_json("GET", "/stats", repeatable=True)

    # ------------------------------------------------------------------ generation
    def _completion_body(self, request: GenerationRequest, stream: bool) -> JSON:
        body: JSON = {
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
            "request_id": request.request_id,
        }
        if request.stop_token_ids:
            body["stop_token_ids"] = list(request.stop_token_ids)
        if self.model:
            body["model"] = self.model
        return body

    def complete(self, request: GenerationRequest) -> Completion:
        """A non-streaming completion (not retried: a repeat would generate twice)."""
        resp = self._call(
            "POST",
            "/v1/completions",
            json_body=self._completion_body(request, False),
            read_timeout=self.timeouts.stream_idle,
        )
        choice = resp.json()["choices"][0]
        tokens = list(choice.get("token_ids") or [])
        versions = choice.get("token_weight_versions") or [UNKNOWN_VERSION] * len(tokens)
        return Completion(request.request_id, tokens, list(versions), choice.get("finish_reason"))

    def text_completion(
        self,
        prompt: str | Sequence[int] | Sequence[str],
        max_tokens: int = 16,
        *,
        stream: bool = False,
        logprobs: int | None = None,
        request_id: str | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> TextCompletion:
        """One greedy /v1/completions call with vLLM's text fields: a text (or token-id) prompt in; the
        text, token ids, per-token versions, logprobs object and usage out. Streamed, the chunks' texts
        are kept in `pieces` and their logprobs joined; usage is asked for (`include_usage`). Not retried:
        a repeat would generate twice."""
        body: JSON = {
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        if request_id is not None:
            body["request_id"] = request_id
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if self.model:
            body["model"] = self.model
        if not stream:
            resp = self._call(
                "POST", "/v1/completions", json_body=body, read_timeout=self.timeouts.stream_idle
            )
            answer = resp.json()
            out = TextCompletion(str(answer.get("id", "")), usage=answer.get("usage"))
            out.add(answer["choices"][0])
            return out
        body["stream_options"] = {"include_usage": True}
        routes.check_call("POST", "/v1/completions")
        out = TextCompletion("")
        try:
            with self._http.stream(
                "POST",
                "/v1/completions",
                json=body,
                headers=self._headers,
                timeout=self._timeout(self.timeouts.stream_idle),
            ) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise error_from_response(resp)
                for chunk in sse_chunks(resp):
                    out.id = out.id or str(chunk.get("id", ""))
                    if chunk.get("usage") is not None:
                        out.usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        out.add(choice)
        except httpx.TransportError as exc:
            raise TransferError(f"POST {self.base_url}/v1/completions: the stream broke: {exc!r}") from exc
        if out.finish_reason is None:
            raise TransferError(
                f"POST {self.base_url}/v1/completions: the stream ended without a finish_reason"
            )
        return out

    def submit(self, request: GenerationRequest, start_timeout: float | None = None) -> RemoteStream:
        """Start a streaming completion; returns once the server accepted it (its response began),
        raising the server's error if it refused."""
        stream = RemoteStream(self, request)
        stream.start()
        stream.wait_accepted(start_timeout or self.timeouts.control)
        return stream


def sse_chunks(resp: httpx.Response) -> Iterator[JSON]:
    """The JSON chunks of a /v1/completions event stream, up to `data: [DONE]` (blank separators and
    `: keepalive` comments skipped)."""
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        if line[6:] == "[DONE]":
            return
        yield json.loads(line[6:])


# --------------------------------------------------------------------------------------------- text
@dataclasses.dataclass
class TextCompletion:
    """What `ControlClient.text_completion` read: one answer, or a stream's chunks joined."""

    id: str
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    logprobs: JSON | None = None  # vLLM's object: tokens, token_logprobs, top_logprobs, text_offset
    usage: JSON | None = None
    pieces: list[str] = dataclasses.field(default_factory=list)  # each chunk's text, in order

    def add(self, choice: Mapping[str, Any]) -> None:
        """Join one choice (a chunk's, or the whole answer's)."""
        text = choice.get("text") or ""
        self.pieces.append(text)
        self.text += text
        tokens = list(choice.get("token_ids") or [])
        self.token_ids += tokens
        self.token_versions += list(choice.get("token_weight_versions") or [UNKNOWN_VERSION] * len(tokens))
        if choice.get("logprobs") is not None:
            if self.logprobs is None:
                self.logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
            for key, values in choice["logprobs"].items():
                self.logprobs.setdefault(key, []).extend(values or [])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    @property
    def cached_tokens(self) -> int | None:
        """usage.prompt_tokens_details.cached_tokens (None when the server does not report it)."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")


# --------------------------------------------------------------------------------------------- streams
class RemoteStream(RequestStream):
    """A RequestStream fed by a thread reading the server's SSE stream: tokens, with the weight version
    that produced each (when the server reports it; UNKNOWN_VERSION otherwise)."""

    def __init__(self, client: ControlClient, request: GenerationRequest):
        super().__init__(request)
        self._client = client
        self._accepted = threading.Event()
        self.status: int | None = None
        self.error: BaseException | None = None  # a refusal, or a transport failure mid-stream
        self.server_request_id: str | None = None  # the completion's id as the server names it
        self._thread = threading.Thread(target=self._read, name=f"sse-{request.request_id[:24]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def abort(self) -> int:
        """Abort this request through /abort_requests, under the id the server knows it by: ours takes
        the request id; vLLM's engine knows the first (only) choice of completion `cmpl-<id>` as `cmpl-<id>-0`."""
        if self._client.server_kind() == "weightsync":
            return self._client.abort_requests([self.request.request_id])
        completion_id = self.server_request_id or f"cmpl-{self.request.request_id}"
        return self._client.abort_requests([f"{completion_id}-0"])

    def wait_accepted(self, timeout: float) -> None:
        if not self._accepted.wait(timeout):
            raise TimeoutError(f"request {self.request.request_id!r}: no response within {timeout}s")
        if self.error is not None and (self.status is None or self.status >= 400):
            if isinstance(self.error, WeightSyncError):
                raise self.error
            raise TransferError(
                f"request {self.request.request_id!r} was not accepted: {self.error!r}"
            ) from self.error

    def _finish(self, index: int, version: int) -> None:
        if not self.done:
            self.push(TokenEvent(self.request.request_id, index, None, version, "abort"))

    def _read(self) -> None:
        c = self._client
        rid = self.request.request_id
        index, version = 0, UNKNOWN_VERSION
        try:
            routes.check_call("POST", "/v1/completions")
            with c._http.stream(
                "POST",
                "/v1/completions",
                json=c._completion_body(self.request, True),
                headers=c._headers,
                timeout=c._timeout(c.timeouts.stream_idle),
            ) as resp:
                self.status = resp.status_code
                if resp.status_code >= 400:
                    resp.read()
                    self.error = error_from_response(resp)
                    return
                self._accepted.set()
                for chunk in sse_chunks(resp):
                    if self.server_request_id is None and isinstance(chunk.get("id"), str):
                        self.server_request_id = chunk["id"]
                    if not chunk.get("choices"):
                        continue  # the usage chunk, or an error object
                    choice = chunk["choices"][0]
                    tokens = choice.get("token_ids") or []
                    versions = choice.get("token_weight_versions") or [UNKNOWN_VERSION] * len(tokens)
                    finish = choice.get("finish_reason")
                    for j, (tok, ver) in enumerate(zip(tokens, versions, strict=True)):
                        version = ver
                        self.push(TokenEvent(rid, index, tok, ver, finish if j == len(tokens) - 1 else None))
                        index += 1
                    if finish is not None and not tokens:
                        self.push(TokenEvent(rid, index, None, version, finish))
                    if finish is not None:
                        break
        except BaseException as exc:  # noqa: BLE001 - recorded, and the stream ends as aborted
            self.error = exc
        finally:
            self._accepted.set()
            if not self.done and self.error is None:
                self.error = TransferError(f"request {rid!r}: the stream ended without a finish_reason")
            self._finish(index, version)
