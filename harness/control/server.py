"""A FastAPI control plane with vLLM's dev-mode routes, in front of any Engine + Receiver.

Routes and bodies follow vLLM 0.32's RL API (VLLM_SERVER_DEV_MODE=1) so one client drives either; the
route table, with each route's body, query, precondition and error statuses, is
`harness.control.routes.ROUTES` (and this server's /openapi.json). The weight lifecycle
(/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update), pause
and sleep, /weight_info and /weight_checker, and /v1/completions (token-id or text prompts, greedy,
text and logprobs out, SSE with per-token weight versions).

Beyond vLLM (vLLM's dev routes have no auth at all):
- a bearer token on every mutating (non-GET) route, compared in constant time; 401 without it
  (no token only on a loopback address, announced at start; other addresses refuse to start);
- bodies bounded in size (413) and validated strictly: unknown fields and wrong types are refused
  with vLLM's error object (400, `param` naming the field); a lifecycle step out of order is a 409,
  decided before the body is read;
- every file path in init_info/update_info confined to allowed directories, every peer address to
  allowed hosts;
- an `Idempotency-Key` header on mutating routes: a retry with the same key gets the first answer
  and never runs the operation twice; a finish of the version already committed is recognised;
- extensions (the table's `vllm=False` routes): /abort_weight_update, /weight_spec, /weight_status
  (the engine version, an open update, this server's name), /stats.

`ServerConfig.vllm_api` names the vLLM API level: "0.32" (the default) or "rfc45585", the RL CI-matrix
prototype's routes (/weight_update_active, /update_weight_label, weight_gen and weight_label in
/weight_info); `harness.control.routes.table` has each level's routes.

Tensors never cross HTTP: update_info carries the manifest and the data plane's coordinates, and the
receiver fetches the bytes itself. Every blocking engine or receiver call runs in a worker thread,
so a long /pause?mode=wait or a slow data plane never stalls the event loop.

Why one file: the operations share one lock and one lifecycle state machine per engine; the rooms that do not
(errors, guard, idempotency, streaming, text, limits) are modules of their own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import dataclasses
import hashlib
import ipaddress
import itertools
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from harness import lifecycle, wire
from harness.api import (
    Engine,
    EngineStateError,
    LifecycleError,
    ManifestMismatch,
    Receiver,
    TokenEvent,
    VersionError,
    WeightSyncError,
)
from harness.control import routes, schemas
from harness.control.errors import (
    ApiError,
    ErrorResponse,
    api_error,
    install_handlers,
    invalid,
    validation_error,
)
from harness.control.guard import Guard
from harness.control.idempotency import IdempotencyCache, fingerprint
from harness.control.schemas import BadRequest
from harness.control.streaming import Completions, Live
from harness.manifest import Manifest

__all__ = [
    "ApiError",
    "ControlServer",
    "Guard",
    "IdempotencyCache",
    "ServerConfig",
    "is_loopback",
    "token_from_environment",
]

log = logging.getLogger("weightsync.control")

SERVER_NAME = "weightsync"
DEFAULT_HOST = "127.0.0.1"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
TOKEN_VARIABLES = ("WEIGHTSYNC_CONTROL_TOKEN", "VLLM_API_KEY")  # ours first; vLLM's --api-key variable


def is_loopback(host: str) -> bool:
    """Whether binding `host` leaves the port reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost, or "" (every address)
        return False


def token_from_environment(environ: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token from $WEIGHTSYNC_CONTROL_TOKEN, else $VLLM_API_KEY (so a deployment that
    sets vLLM's key and clients that send `Authorization: Bearer <key>` work unchanged)."""
    for name in TOKEN_VARIABLES:
        if environ.get(name):
            return environ[name]
    return None


# --------------------------------------------------------------------------------------------- config
@dataclasses.dataclass
class ServerConfig:
    """How a control server is exposed. `token=None` turns authentication off, which only a loopback
    address allows (the port is then reachable from this machine alone); any other address refuses to
    start without a token."""

    token: str | None
    host: str = DEFAULT_HOST
    port: int = 0  # 0: an ephemeral port, read back from ServerThread.port
    allowed_dirs: tuple[Path, ...] = ()  # file paths in init_info/update_info must lie under one of these
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS  # peer addresses init_info may name
    init_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # e.g. this server's rank
    max_body_bytes: int = 1 << 20
    max_inflight_requests: int = 256
    # seconds between ': keepalive' SSE comments while a stream is idle (paused), for proxies that cut
    # idle connections; None, vLLM's behaviour: nothing but `data:` lines (its clients assert that)
    keepalive_s: float | None = None
    model_name: str = SERVER_NAME
    control_threads: int = 8
    stream_threads: int = 4  # pumps for engine streams without RequestStream.subscribe (polled in slices)
    idempotency_capacity: int = 4096
    world_size: int = 1  # /get_world_size: inference workers behind this server (TP x PP)
    worker_index: int = 0  # which element of a list update_info is this server's (vLLM: its global rank)
    workdir: Path | None = None  # where /sleep offloads weights; None: a temporary directory
    # which vLLM's routes and answers: "0.32" or "rfc45585" (harness.control.routes.VLLM_API_LEVELS)
    vllm_api: str = routes.DEFAULT_VLLM_API

    def __post_init__(self) -> None:
        routes.check_level(self.vllm_api)
        if self.token is None:
            if not is_loopback(self.host):
                raise ValueError(
                    f"no control token for host {self.host!r}: a server on a non-loopback address requires "
                    f"one (set {' or '.join(TOKEN_VARIABLES)}, or pass --token-file); bind 127.0.0.1 to run "
                    "without authentication"
                )
        elif not isinstance(self.token, str) or len(self.token) < 16:
            raise ValueError("the control token must be a string of at least 16 characters")
        self.allowed_dirs = tuple(Path(d) for d in self.allowed_dirs)

    @property
    def auth(self) -> bool:
        """Whether mutating routes require the bearer token."""
        return self.token is not None


# --------------------------------------------------------------------------------------------- server
class ControlServer(Completions):
    """The control plane for one engine and the receiver that delivers into it. Its routes are
    `harness.control.routes.ROUTES`; each names the `on_*` coroutine here that answers it."""

    def __init__(self, engine: Engine, receiver: Receiver, config: ServerConfig):
        self.engine = engine
        self.receiver = receiver
        self.config = config
        self._control_pool = cf.ThreadPoolExecutor(config.control_threads, thread_name_prefix="control")
        self._query_pool = cf.ThreadPoolExecutor(4, thread_name_prefix="control-query")
        self._stream_pool = cf.ThreadPoolExecutor(config.stream_threads, thread_name_prefix="control-stream")
        self._pause_lock = threading.Lock()  # pause, resume and abort-all never interleave
        self._state_lock = threading.Lock()  # the lifecycle bookkeeping below
        # Where the update stands, as every receiver keeps it: open (UPDATING, or FAILED after a refused
        # part), the version staged in it, why it can no longer commit. The receiver enforces the order;
        # the server reads it to answer 409 before a body is read, and to recognise a retried finish.
        self.lifecycle = lifecycle.Lifecycle()
        self._label: str | None = None  # vLLM-style version label, reported by /weight_info
        # the rfc45585 level's weight version: finishes that committed (monotonic), and the client's label
        self._gen = 0
        self._weight_label = schemas.INITIAL_WEIGHT_LABEL
        self.routes = routes.table(config.vllm_api)
        self._finish_body = next(r.body for r in self.routes if r.path == "/finish_weight_update")
        self._asleep: set[str] = set()  # what /sleep put to sleep and /wake_up has not woken yet
        self._sleep_level = 0
        self._own_workdir = config.workdir is None
        self.workdir = Path(config.workdir or tempfile.mkdtemp(prefix="weightsync-control-"))
        self._idempotency = IdempotencyCache(config.idempotency_capacity)
        self._live: dict[str, Live] = {}
        self.counters = collections.Counter()  # submitted, completed, aborted, disconnected, commits, ...
        self._ids = itertools.count()
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None  # uvicorn's, once a request arrived
        self.app = self._build_app()
        self.asgi = Guard(self.app, config.token, config.max_body_bytes)

    # ------------------------------------------------------------------ plumbing
    async def _in_thread(self, fn: Callable[[], Any], pool: cf.Executor | None = None) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool or self._control_pool, fn)
        except ApiError:
            raise
        except Exception as exc:
            err = api_error(exc)
            if err is None:
                raise
            raise err from exc

    @property
    def _updating(self) -> bool:
        """A start_weight_update is open (a refused part keeps it open until finish or abort)."""
        return self.lifecycle.state in (lifecycle.UPDATING, lifecycle.FAILED)

    @staticmethod
    def _query(request: Request, allowed: tuple[str, ...], lists: tuple[str, ...] = ()) -> dict[str, Any]:
        """The query as {name: value}, refusing unknown and repeated names (`lists` may repeat: a list)."""
        params = request.query_params
        unknown = sorted(set(params.keys()) - set(allowed))
        if unknown:
            raise invalid(
                f"unknown query parameter(s) {unknown[:5]}; allowed: {list(allowed)}",
                f"query.{unknown[0][:64]}",
            )
        out = {}
        for k in params:
            values = params.getlist(k)
            if k in lists:
                out[k] = values
                continue
            if len(values) != 1:
                raise invalid(f"query parameter {k!r} given {len(values)} times", f"query.{k}")
            out[k] = values[0]
        return out

    @staticmethod
    async def _body(request: Request, model: type[BaseModel], required: bool) -> Any:
        raw = await request.body()
        if not raw.strip():
            if required:
                raise invalid(f"{request.url.path}: a JSON body is required", "body")
            return model()
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise ApiError(415, "UnsupportedMediaType", f"content-type {ctype[:80]!r}: send application/json")
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def _mutation(self, request: Request, body: Any, op: Callable[[], dict[str, Any]]) -> JSONResponse:
        """Run a mutating operation in a thread; with an Idempotency-Key, at most once per key."""

        async def run() -> tuple[int, dict[str, Any]]:
            try:
                return 200, await self._in_thread(op)
            except ApiError as exc:
                return exc.status, exc.payload()

        key = request.headers.get("idempotency-key")
        if key is None:
            status, payload = await run()
        else:
            if not schemas.IDEMPOTENCY_KEY_RE.match(key):
                raise invalid(
                    f"Idempotency-Key must match {schemas.IDEMPOTENCY_KEY_RE.pattern}",
                    "header.idempotency-key",
                )
            bound_to = fingerprint(request.url.path, request.query_params.multi_items(), body)
            status, payload = await self._idempotency.run(key, bound_to, run)
        return JSONResponse(payload, status_code=status)

    # ------------------------------------------------------------------ lifecycle (run in threads)
    def _confine(self, info: Mapping[str, Any], what: str) -> None:
        schemas.confine_paths(info, self.config.allowed_dirs, self.config.allowed_hosts, what)

    def _init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        self._confine(init_info, "init_info")
        info = {**init_info, **self.config.init_overrides}
        with self._state_lock:
            self.receiver.init_transfer_engine(info)
            self.lifecycle.to(lifecycle.READY)
        return {"message": "Weight transfer initialized"}

    @property
    def _rfc45585(self) -> bool:
        return self.config.vllm_api == "rfc45585"

    def _start(self) -> dict[str, Any]:
        if "weights" in self._asleep:
            raise EngineStateError(
                "start_weight_update: the engine is asleep (weights offloaded); wake_up first"
            )
        with self._state_lock:
            if self._rfc45585 and self.lifecycle.state == lifecycle.NEW:
                # vLLM's worker raises before its state machine is touched; its catch-all answers 500
                raise ApiError(
                    500,
                    "InternalServerError",
                    "start_weight_update: weight transfer not configured; call init_weight_transfer_engine first",
                )
            if self._rfc45585 and self._updating:
                # the prototype's state machine: open until finish, a refused part included (0.32 restarts)
                raise LifecycleError(
                    "start_weight_update called while a weight update is already in progress; call "
                    "finish_weight_update (or abort_weight_update) first"
                )
            self.receiver.start_weight_update()
            self.lifecycle.to(lifecycle.UPDATING)
        return {"message": "Weight update started"}

    def _check_manifest_bounds(self, update_info: Mapping[str, Any]) -> None:
        """Refuse a manifest whose buckets claim more bytes than the engine could ever hold, before a
        data plane allocates them."""
        if "manifest" not in update_info:
            raise ManifestMismatch("update_info carries no 'manifest'")
        manifest = Manifest.from_json(update_info["manifest"])
        if not 1 <= manifest.version <= schemas.MAX_VERSION:
            raise VersionError(f"manifest version {manifest.version} outside 1..{schemas.MAX_VERSION}")
        spec = self.engine.weight_spec()
        capacity = sum(s.dtype.itemsize * _numel(s.shape) for s in spec.values())
        slack = 64 * (len(manifest.entries) + len(manifest.bucket_sizes))
        if any(size < 0 for size in manifest.bucket_sizes) or sum(manifest.bucket_sizes) > capacity + slack:
            raise ManifestMismatch(
                f"version {manifest.version}: buckets total {sum(manifest.bucket_sizes)} bytes, more than the "
                f"{capacity} bytes the engine holds"
            )

    def _require_open_update(self, request: Request, what: str) -> None:
        """Start before update and finish: a step out of order is a 409 whatever its body says, so this
        runs before the body is read; a replay of an answer already given by Idempotency-Key is exempt."""
        if self._updating or self._idempotency.knows(request.headers.get("idempotency-key")):
            return
        raise ApiError(409, "LifecycleError", f"{what} outside an update; call start_weight_update first")

    def _own_update_info(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        """vLLM's list form carries one object per inference worker: this server takes its own."""
        if isinstance(update_info, dict):
            return update_info
        i = self.config.worker_index
        if i >= len(update_info):
            raise invalid(
                f"update_info is a list of {len(update_info)}, no element at this server's worker index {i}",
                "body.update_info",
            )
        return update_info[i]

    def _update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        with self._state_lock:
            try:
                self._confine(update_info, "update_info")
                self._check_manifest_bounds(update_info)
                self.receiver.update_weights(update_info)
            except WeightSyncError as exc:
                if self._updating:  # a refused part poisons the update: finish must not commit the rest
                    self.lifecycle.fail(exc)
                raise
            self.lifecycle.accepted(int(update_info["manifest"]["version"]))
        return {"message": "Weights updated"}

    def _finish(self, weight_version: int | str | None, weight_label: str | None = None) -> dict[str, Any]:
        version, label = schemas.parse_version(weight_version)
        with self._state_lock:
            committed = self.engine.weight_version
            if version is not None and version == committed and not self._updating:
                # a retry of a finish that already landed (its answer was lost): recognised, not re-applied
                self.counters["finish_recognised"] += 1
                return self._finish_answer(str(version), already_committed=True)
            if version is not None and version <= committed:
                # with an update open this is no retry: answering 200 would report a commit that never ran
                staged = self.lifecycle.version
                raise VersionError(
                    f"finish_weight_update({version}) but version {committed} is already committed"
                    + (f" and version {staged} is staged" if self._updating and staged is not None else "")
                )
            if self.lifecycle.failure is not None:
                failure = self.lifecycle.failure
                self.receiver.abort_weight_update()
                self.lifecycle.to(lifecycle.READY)
                raise LifecycleError(f"finish_weight_update after a refused update_weights: {failure}")
            if version is None:
                if self.lifecycle.version is None:
                    raise LifecycleError(
                        "finish_weight_update with nothing staged; call update_weights first"
                    )
                version = self.lifecycle.version
            try:
                self.receiver.finish_weight_update(version)
            except VersionError:
                raise  # a wrong version leaves the update open, as the receiver does
            except BaseException:
                self.lifecycle.to(lifecycle.READY)
                raise
            self.lifecycle.to(lifecycle.READY)
            self._label = label
            self._gen += 1  # after the commit landed: no window where gen is ahead of the weights
            if weight_label is not None:
                self._weight_label = weight_label
            self.counters["commits"] += 1
            return self._finish_answer(label or str(version), already_committed=False)

    def _finish_answer(self, weight_version: str, already_committed: bool) -> dict[str, Any]:
        """0.32's answer plus ours (`weight_version`, `already_committed`); rfc45585 adds its
        `weight_gen` and `weight_label` (a recognised retry reports them unchanged)."""
        answer: dict[str, Any] = {"message": "Weight update finished"}
        if self._rfc45585:
            answer |= {"weight_gen": self._gen, "weight_label": self._weight_label}
        return answer | {"weight_version": weight_version, "already_committed": already_committed}

    def _abort_update(self) -> dict[str, Any]:
        with self._state_lock:
            self.receiver.abort_weight_update()
            self.lifecycle.to(lifecycle.READY)
        return {"message": "Weight update aborted", "weight_version": str(self.engine.weight_version)}

    def _shutdown_transfer(self) -> dict[str, Any]:
        with self._state_lock:
            self.receiver.shutdown()
            self.lifecycle.to(lifecycle.NEW)
        return {"message": "Weight transfer shut down"}

    def _pause(self, mode: str, clear_cache: bool) -> dict[str, Any]:
        with self._pause_lock:
            self.engine.pause(mode, clear_cache=clear_cache)  # type: ignore[arg-type]
        return {"status": "paused"}

    def _resume(self) -> dict[str, Any]:
        with self._pause_lock:
            self.engine.resume()
        return {"status": "resumed"}

    def _abort_all(self) -> int:
        """Abort every in-flight request without leaving the engine paused (the Engine contract has no
        per-request abort: pause(abort) aborts everything; resume unless it was paused already)."""
        with self._pause_lock:
            n = sum(1 for live in list(self._live.values()) if not live.closed)
            was_paused = self.engine.is_paused
            self.engine.pause("abort", clear_cache=False)
            if not was_paused:
                self.engine.resume()
        return n

    def version_label(self) -> str:
        """What /weight_info reports: the last label, else the committed version ("default" before any,
        as vLLM says)."""
        committed = self.engine.weight_version
        return self._label or (schemas.INITIAL_VERSION_LABEL if committed == 0 else str(committed))

    def weight_info(self) -> dict[str, Any]:
        """vLLM's /weight_info, exactly: the label at 0.32; at rfc45585 the prototype's
        `{"weight_gen", "weight_label"}` (finishes committed so far, the client's label)."""
        if self._rfc45585:
            return {"weight_gen": self._gen, "weight_label": self._weight_label}
        return {"weight_version": self.version_label()}

    def weight_status(self) -> dict[str, Any]:
        """/weight_status: /weight_info plus what this harness's client reads (engine version, an open
        update, whether Idempotency-Key is honoured)."""
        committed = self.engine.weight_version
        return {
            "weight_version": self.version_label(),
            "engine_version": committed,
            "update_in_progress": self._updating,
            "server": SERVER_NAME,
            "idempotency_keys": True,
        } | ({"weight_gen": self._gen, "weight_label": self._weight_label} if self._rfc45585 else {})

    # ------------------------------------------------------------------ sleep and weight checks
    def _offload_path(self) -> Path:
        return self.workdir / "sleep-weights.safetensors"

    def _sleep(self, level: int, mode: str) -> dict[str, Any]:
        offload = getattr(self.engine, "offload_weights", None)
        if level >= 1 and not callable(offload):
            raise ApiError(
                501, "NotImplementedError", f"{type(self.engine).__name__} cannot offload its weights"
            )
        with self._pause_lock:
            self.engine.pause(mode, clear_cache=level >= 1)  # type: ignore[arg-type]
            if level >= 1 and "weights" not in self._asleep:
                offload(self._offload_path() if level == 1 else None)
                self._asleep |= {"weights", "kv_cache"}
                self._sleep_level = level
        return {"status": "sleeping", "level": level}

    def _wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        with self._pause_lock:
            waking = set(tags) - {"scheduling"} if tags is not None else set(self._asleep)
            if "weights" in waking and "weights" in self._asleep:
                path = self._offload_path() if self._sleep_level == 1 else None
                self.engine.restore_weights(path)  # type: ignore[attr-defined]
                if path is not None:
                    path.unlink(missing_ok=True)
            self._asleep -= waking
            fully_awake = not self._asleep
            if fully_awake:  # vLLM resumes scheduling once everything is resident again
                self.engine.resume()
        return {"status": "awake" if fully_awake else "sleeping", "tags": tags}

    def is_sleeping(self) -> bool:
        """vLLM's answer: asleep at any level, which includes a paused scheduler."""
        return bool(self._asleep) or self.engine.is_paused

    def _weight_checker(self, body: schemas.WeightCheckerBody) -> dict[str, Any]:
        if body.action == "reset":
            zero = getattr(self.engine, "zero_weights", None)
            if not callable(zero):
                raise ApiError(
                    501, "NotImplementedError", f"{type(self.engine).__name__} cannot zero its weights"
                )
            zero()
            return {"status": "reset"}
        if body.action == "compare" and body.baseline is None:
            raise invalid("action='compare' requires a 'baseline' object", None)
        checksums = {CHECKSUM_PREFIX + n: tensor_sha256(t) for n, t in self.engine.read_weights().items()}
        if body.action == "checksum":
            return {"checksums": checksums}
        baseline = body.baseline or {}
        mismatches = sorted(
            k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
        )
        return {"match": not mismatches, "mismatches": mismatches}

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "submitted": c["submitted"],
            "completed": c["completed"],
            "aborted": c["abort"],
            "disconnected": c["disconnected"],
            "in_flight": len(self._live),
            "commits": c["commits"],
            "finish_recognised": c["finish_recognised"],
            "idempotent_replays": self._idempotency.replays,
            # closed by harness.control.limits: header_timeout, body_timeout, evicted, refused
            "connections": {
                k.removeprefix("connections_"): v for k, v in c.items() if k.startswith("connections_")
            },
        }

    def live_streams(self) -> dict[str, Any]:
        """The engine-side streams of in-flight requests, by request id (for white-box checks)."""
        return {rid: live.stream for rid, live in list(self._live.items())}

    # ------------------------------------------------------------------ routes (registered from routes.ROUTES)
    async def require_open_update(self, request: Request) -> None:
        """Start before update: a step out of order is a 409 whatever its body says, so this runs before
        the body is read; a replay of an answer already given by Idempotency-Key is exempt."""
        self._require_open_update(request, request.url.path.lstrip("/"))

    async def require_open_update_or_committed(self, request: Request) -> None:
        """Finish without an open update goes on only when it names a committed version (a retry of the
        finish that landed is recognised; an older one is a VersionError); the rest is out of order,
        whatever the body says."""
        if self._updating:
            return
        try:
            early = await self._body(request, self._finish_body, required=False)
            named = schemas.parse_version(early.weight_version)[0]
        except (ApiError, BadRequest):
            named = None
        if named is None or named > self.engine.weight_version:
            self._require_open_update(request, "finish_weight_update")

    async def on_pause(self, request: Request, q: dict[str, Any], body: Any):
        mode = q.get("mode", "abort")
        if mode not in schemas.PAUSE_MODES:
            raise invalid(f"mode={mode[:40]!r}: must be one of {list(schemas.PAUSE_MODES)}", "query.mode")
        clear_cache = schemas.parse_query_bool("clear_cache", q.get("clear_cache"), True)  # vLLM's default
        if schemas.parse_query_bool("wait_for_inflight_requests", q.get("wait_for_inflight_requests"), False):
            mode = "wait" if mode == "abort" else mode  # vLLM's deprecated spelling of mode=wait
        return await self._mutation(request, body, lambda: self._pause(mode, clear_cache))

    async def on_resume(self, request: Request, q: dict[str, Any], body: Any):
        return await self._mutation(request, body, self._resume)

    async def on_is_paused(self, request: Request, q: dict[str, Any], body: Any):
        return {"is_paused": await self._in_thread(lambda: self.engine.is_paused, self._query_pool)}

    async def on_init(self, request: Request, q: dict[str, Any], body: schemas.InitWeightTransferBody):
        return await self._mutation(request, body, lambda: self._init(body.init_info))

    async def on_start(self, request: Request, q: dict[str, Any], body: Any):
        return await self._mutation(request, body, self._start)

    async def on_update(self, request: Request, q: dict[str, Any], body: schemas.UpdateWeightsBody):
        info = self._own_update_info(body.update_info)
        return await self._mutation(request, body, lambda: self._update(info))

    async def on_finish(self, request: Request, q: dict[str, Any], body: schemas.FinishWeightUpdateBody):
        label = getattr(body, "weight_label", None)  # the rfc45585 level's body has it
        return await self._mutation(request, body, lambda: self._finish(body.weight_version, label))

    async def on_abort_update(self, request: Request, q: dict[str, Any], body: Any):
        return await self._mutation(request, body, self._abort_update)

    async def on_shutdown_transfer(self, request: Request, q: dict[str, Any], body: Any):
        return await self._mutation(request, body, self._shutdown_transfer)

    async def on_update_weight_version(
        self, request: Request, q: dict[str, Any], body: schemas.UpdateWeightVersionBody
    ):
        def op() -> dict[str, Any]:
            self._label = body.new_version
            return {"success": True, "new_version": body.new_version}

        return await self._mutation(request, body, op)

    async def on_weight_info(self, request: Request, q: dict[str, Any], body: Any):
        return await self._in_thread(self.weight_info, self._query_pool)

    async def on_weight_status(self, request: Request, q: dict[str, Any], body: Any):
        return await self._in_thread(self.weight_status, self._query_pool)

    async def on_weight_update_active(self, request: Request, q: dict[str, Any], body: Any):
        """rfc45585: an update is open from a start until its finish (or our abort), a refused part
        included; a finish refused for its version leaves it open."""
        return {"weight_update_active": self._updating}

    async def on_update_weight_label(
        self, request: Request, q: dict[str, Any], body: schemas.UpdateWeightLabelBody
    ):
        def op() -> dict[str, Any]:
            with self._state_lock:
                self._weight_label = body.weight_label
                return {"weight_gen": self._gen, "weight_label": self._weight_label}

        return await self._mutation(request, body, op)

    async def on_weight_checker(self, request: Request, q: dict[str, Any], body: schemas.WeightCheckerBody):
        return await self._mutation(request, body, lambda: self._weight_checker(body))

    async def on_get_world_size(self, request: Request, q: dict[str, Any], body: Any):
        schemas.parse_query_bool("include_dp", q.get("include_dp"), True)
        return {"world_size": self.config.world_size}  # one engine: no data-parallel replicas here

    async def on_weight_spec(self, request: Request, q: dict[str, Any], body: Any):
        return wire.spec_to_json(await self._in_thread(self.engine.weight_spec, self._query_pool))

    async def on_sleep(self, request: Request, q: dict[str, Any], body: Any):
        raw_level = q.get("level", "1")
        if raw_level not in ("0", "1", "2"):
            raise invalid(f"level={raw_level[:40]!r}: must be 0, 1 or 2", "query.level")
        mode = q.get("mode", "abort")
        if mode not in schemas.PAUSE_MODES:
            raise invalid(f"mode={mode[:40]!r}: must be one of {list(schemas.PAUSE_MODES)}", "query.mode")
        return await self._mutation(request, body, lambda: self._sleep(int(raw_level), mode))

    async def on_wake_up(self, request: Request, q: dict[str, Any], body: Any):
        tags = q.get("tags") or None
        for tag in tags or ():
            if tag not in schemas.SLEEP_TAGS:
                raise invalid(f"tag {tag[:40]!r}: must be one of {list(schemas.SLEEP_TAGS)}", "query.tags")
        return await self._mutation(request, body, lambda: self._wake_up(tags))

    async def on_is_sleeping(self, request: Request, q: dict[str, Any], body: Any):
        return {"is_sleeping": await self._in_thread(self.is_sleeping, self._query_pool)}

    async def on_reset_prefix_cache(self, request: Request, q: dict[str, Any], body: Any):
        for name in q:
            schemas.parse_query_bool(name, q[name], False)

        def op() -> dict[str, Any]:
            self.engine.reset_prefix_cache()
            return {"success": True}  # vLLM 0.32's answer

        return await self._mutation(request, body, op)

    async def on_health(self, request: Request, q: dict[str, Any], body: Any):
        return {}

    async def on_stats(self, request: Request, q: dict[str, Any], body: Any):
        return self.stats()

    async def on_load(self, request: Request, q: dict[str, Any], body: Any):
        return {"server_load": len(self._live)}

    # ------------------------------------------------------------------ app
    def _endpoint(self, route: routes.Route) -> Callable[[Request], Any]:
        """One route's endpoint: its precondition, then its query and body as the table says, then its
        handler."""
        handler = getattr(self, route.handler)
        precondition = getattr(self, route.precondition) if route.precondition else None

        async def endpoint(request: Request):
            if precondition is not None:
                await precondition(request)
            q = self._query(request, route.query, route.query_lists)
            body = await self._body(request, route.body, route.body_required) if route.body else None
            return await handler(request, q, body)

        endpoint.__name__ = route.handler
        return endpoint

    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="weightsync control plane", description=__doc__, version="1", docs_url=None, redoc_url=None
        )
        install_handlers(app)
        for r in self.routes:
            app.add_api_route(
                r.path,
                self._endpoint(r),
                methods=[r.method],
                summary=r.summary,
                responses=routes.openapi_responses(r, self.config.auth, ErrorResponse),
            )
        self._document_bodies(app, auth=self.config.auth, table=self.routes)
        return app

    @staticmethod
    def _document_bodies(app: FastAPI, auth: bool, table: tuple[routes.Route, ...] = routes.ROUTES) -> None:
        """Bodies are parsed by hand (strictly); put the table's body schemas in the OpenAPI document."""

        def openapi() -> dict[str, Any]:
            if app.openapi_schema:
                return app.openapi_schema
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for r in table:
                request_body = routes.openapi_request_body(r)
                if request_body is None:
                    continue
                schema = r.body.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                components[r.body.__name__] = schema
                doc["paths"][r.path][r.method.lower()]["requestBody"] = request_body
            if auth:
                doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = doc
            return doc

        app.openapi = openapi  # type: ignore[method-assign]

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """End every open stream (finish_reason abort) and stop the worker threads."""
        self._closing = True
        version = self.engine.weight_version
        for live in list(self._live.values()):
            live.closed = True
            if self._loop is not None and not self._loop.is_closed():  # wake its SSE generator now
                final = [TokenEvent(live.request_id, live.tokens, None, version, "abort")]
                self._loop.call_soon_threadsafe(live.queue.put_nowait, final)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        self._query_pool.shutdown(wait=False, cancel_futures=True)
        self._stream_pool.shutdown(wait=False, cancel_futures=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


CHECKSUM_PREFIX = "dp0:pp0:pcp0:tp0:"  # vLLM's per-worker key prefix; this server is one worker


def tensor_sha256(t: Any) -> str:
    """SHA-256 of a tensor's raw bytes in memory order (what /weight_checker compares)."""
    flat = t.detach().cpu().contiguous().view(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
