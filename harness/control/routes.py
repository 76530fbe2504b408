"""The control plane's one route table: method, path, body, query, lifecycle precondition, handler and
the error statuses each route can answer.

The server registers its handlers from it (`register`), its OpenAPI document lists each route's
body and error answers from it, the client checks every call it makes against it, and the fuzz
test (suites/control/test_fuzz.py) enumerates its routes from it, so the four cannot drift apart.

`ROUTES` is the table of the default vLLM API level, 0.32. `table(vllm_api)` is the table of a level:
"rfc45585" adds the routes and answers of the RL CI-matrix prototype (vLLM RFC #45585; not merged into
vLLM main, whose router has none of them): GET /weight_update_active, POST
/update_weight_label, `weight_label` in the finish body, and a 500 for a start before init.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel

from harness.control import schemas

# Every route: a bad query or Content-Length (400), a body over the limit (413: the guard bounds the
# body of every method, before routing). Every POST: its body parsed as JSON (415), the bearer token
# (401, when the server has one). Routes that honour Idempotency-Key: a key reused for another
# request (422).
COMMON = frozenset({400, 413})
POST_COMMON = frozenset({415})
AUTH = 401
KEY_REUSED = 422


@dataclasses.dataclass(frozen=True)
class Route:
    """One route. `handler` names the ControlServer coroutine `(request, query, body)` that answers it;
    `precondition` one run before the query and body are read (a lifecycle step out of order is a 409
    whatever the body says); `errors` the statuses of its own refusals, beyond the common ones."""

    method: str
    path: str
    handler: str
    summary: str
    body: type[BaseModel] | None = None  # POST: EmptyBody when it takes none (an empty or `{}` body)
    body_required: bool = False
    query: tuple[str, ...] = ()
    query_lists: tuple[str, ...] = ()  # parameters that may repeat (vLLM's ?tags=a&tags=b)
    precondition: str | None = None
    errors: frozenset[int] = frozenset()
    keyed: bool = False  # honours Idempotency-Key: a retry gets the first answer
    vllm: bool = True  # vLLM serves it too (at the table's API level)

    @property
    def mutating(self) -> bool:
        return self.method != "GET"

    def error_statuses(self, auth: bool = True) -> frozenset[int]:
        """Every non-2xx status this route answers by design (500 is a bug, never declared, except where
        an API level copies vLLM's: rfc45585's start before init)."""
        statuses = set(COMMON | self.errors)
        if self.mutating:
            statuses |= POST_COMMON
            if auth:
                statuses.add(AUTH)
        if self.keyed:
            statuses.add(KEY_REUSED)
        return frozenset(statuses)


def _s(*statuses: int) -> frozenset[int]:
    return frozenset(statuses)


_EMPTY = schemas.EmptyBody
_LIFECYCLE = _s(409)  # LifecycleError, VersionError, EngineStateError
_DATA_PLANE = _s(409, 422, 502)  # + UnknownTensorError / ManifestMismatch, TransferError

ROUTES: tuple[Route, ...] = (
    # pause / resume
    Route("POST", "/pause", "on_pause", "Pause scheduling: abort, wait or keep in-flight requests", _EMPTY,
          query=("mode", "clear_cache", "wait_for_inflight_requests"), errors=_LIFECYCLE, keyed=True),
    Route("POST", "/resume", "on_resume", "Resume scheduling", _EMPTY, errors=_LIFECYCLE, keyed=True),
    Route("GET", "/is_paused", "on_is_paused", "Whether scheduling is paused"),
    Route("POST", "/abort_requests", "on_abort_requests", "Abort requests by id (all when none)",
          schemas.AbortRequestsBody),
    # the weight lifecycle
    Route("POST", "/init_weight_transfer_engine", "on_init", "Set up the data plane",
          schemas.InitWeightTransferBody, body_required=True, errors=_s(409, 502), keyed=True),
    Route("POST", "/start_weight_update", "on_start", "Open an update", schemas.StartWeightUpdateBody,
          errors=_LIFECYCLE, keyed=True),
    Route("POST", "/update_weights", "on_update", "Receive one part of the open update",
          schemas.UpdateWeightsBody, body_required=True, precondition="require_open_update",
          errors=_DATA_PLANE, keyed=True),
    Route("POST", "/finish_weight_update", "on_finish", "Commit the open update",
          schemas.FinishWeightUpdateBody, precondition="require_open_update_or_committed",
          errors=_DATA_PLANE, keyed=True),
    Route("POST", "/abort_weight_update", "on_abort_update", "Drop the open update", _EMPTY,
          errors=_LIFECYCLE, keyed=True, vllm=False),
    Route("POST", "/shutdown_weight_transfer_engine", "on_shutdown_transfer", "Tear down the data plane",
          _EMPTY, keyed=True),
    Route("POST", "/update_weight_version", "on_update_weight_version", "Relabel the served version",
          schemas.UpdateWeightVersionBody, body_required=True, keyed=True),
    Route("GET", "/weight_info", "on_weight_info", "The served version's label (vLLM's answer exactly)"),
    Route("GET", "/weight_status", "on_weight_status", "weight_info plus engine version, open update, server",
          vllm=False),
    Route("POST", "/weight_checker", "on_weight_checker", "Checksum, compare or reset the weights",
          schemas.WeightCheckerBody, body_required=True, errors=_s(409, 501), keyed=True),
    Route("GET", "/get_world_size", "on_get_world_size", "Inference workers behind this server",
          query=("include_dp",)),
    Route("GET", "/weight_spec", "on_weight_spec", "Names, shapes and dtypes of the engine's weights",
          vllm=False),
    # sleep
    Route("POST", "/sleep", "on_sleep", "Pause, then offload (level 1) or discard (level 2) the weights",
          _EMPTY, query=("level", "mode"), errors=_s(409, 501), keyed=True),
    Route("POST", "/wake_up", "on_wake_up", "Wake the tags (all when none)", _EMPTY, query=("tags",),
          query_lists=("tags",), errors=_LIFECYCLE, keyed=True),
    Route("GET", "/is_sleeping", "on_is_sleeping", "Whether anything is asleep, a paused scheduler included"),
    Route("POST", "/reset_prefix_cache", "on_reset_prefix_cache", "Drop the prefix cache", _EMPTY,
          query=("reset_running_requests", "reset_external"), errors=_LIFECYCLE, keyed=True),
    # generation and status
    Route("POST", "/v1/completions", "on_completions", "Completions, text or token ids in, SSE with per-token versions",
          schemas.CompletionBody, body_required=True, errors=_s(404, 409, 429, 503)),
    Route("GET", "/health", "on_health", "Liveness"),
    Route("GET", "/load", "on_load", "Completions in flight (vLLM's --enable-server-load-tracking answer)"),
    Route("GET", "/stats", "on_stats", "Request and commit counters", vllm=False),
)  # fmt: skip

# ------------------------------------------------------------------------------------- API levels
# Which vLLM's routes the server speaks (ServerConfig.vllm_api, --vllm-api). "0.32": vLLM 0.32's RL
# router; vLLM main's (vllm/entrypoints/rl/online/api_router.py) has none of rfc45585's routes either,
# and its /weight_info still answers {"weight_version"}. "rfc45585": the
# prototype of vLLM's RL CI matrix (RFC #45585: tests/entrypoints/serve/dev/rlhf/test_weight_info.py,
# test_state_machine_enforcement.py), which RFC #48306 records as "not upstreamed to vLLM main".
VLLM_API_LEVELS = ("0.32", "rfc45585")
DEFAULT_VLLM_API = "0.32"

# A level's changes to ROUTES, by (method, path): the fields it replaces.
_LEVEL_CHANGES: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
    "rfc45585": {
        # start before init: vLLM's worker raises "Weight transfer not configured" (500); a double start
        # is the state machine's 409
        ("POST", "/start_weight_update"): {"errors": _s(409, 500)},
        # finish takes the label its answer and /weight_info report
        ("POST", "/finish_weight_update"): {"body": schemas.FinishWeightUpdateLabelBody},
        ("GET", "/weight_info"): {
            "summary": "weight_gen (finishes so far) and weight_label (the prototype's answer)"
        },
    },
}
# A level's routes beyond ROUTES.
_LEVEL_ROUTES: dict[str, tuple[Route, ...]] = {
    "rfc45585": (
        Route(
            "GET",
            "/weight_update_active",
            "on_weight_update_active",
            "Whether a weight update is open (started, not finished or aborted)",
        ),
        Route(
            "POST",
            "/update_weight_label",
            "on_update_weight_label",
            "Set weight_label without changing weight_gen",
            schemas.UpdateWeightLabelBody,
            body_required=True,
            keyed=True,
        ),
    ),
}


def check_level(vllm_api: str) -> str:
    """`vllm_api` if it names a level, else a ValueError saying which there are."""
    if vllm_api in VLLM_API_LEVELS:
        return vllm_api
    hint = ""
    if vllm_api in ("main", "nightly", "dev"):
        hint = (
            f"; vLLM {vllm_api}'s RL router has 0.32's routes (no /weight_update_active, no weight_gen): "
            "use '0.32'. 'rfc45585' is the RL CI-matrix prototype with those routes, not merged into main"
        )
    raise ValueError(f"vllm_api {vllm_api!r}: must be one of {list(VLLM_API_LEVELS)}{hint}")


def table(vllm_api: str = DEFAULT_VLLM_API) -> tuple[Route, ...]:
    """The route table of one vLLM API level: ROUTES with the level's changes, then its own routes."""
    changes = _LEVEL_CHANGES.get(check_level(vllm_api), {})
    changed = tuple(dataclasses.replace(r, **changes.get((r.method, r.path), {})) for r in ROUTES)
    return changed + _LEVEL_ROUTES.get(vllm_api, ())


_BY_KEY = {(r.method, r.path): r for r in ROUTES}


def find(method: str, path: str, vllm_api: str = DEFAULT_VLLM_API) -> Route | None:
    if vllm_api == DEFAULT_VLLM_API:
        return _BY_KEY.get((method.upper(), path))
    return next((r for r in table(vllm_api) if (r.method, r.path) == (method.upper(), path)), None)


def route(method: str, path: str, vllm_api: str = DEFAULT_VLLM_API) -> Route:
    """The table's route, or a ValueError naming the routes there are (a call the table lacks is a bug)."""
    found = find(method, path, vllm_api)
    if found is None:
        known = sorted(f"{r.method} {r.path}" for r in table(vllm_api))
        raise ValueError(f"{method} {path} is not in harness.control.routes.ROUTES: {known}")
    return found


def check_call(method: str, path: str, params: Iterable[str] = (), vllm_api: str = DEFAULT_VLLM_API) -> Route:
    """A client's call against the table: the route exists and takes these query parameters."""
    r = route(method, path, vllm_api)
    unknown = sorted(set(params) - set(r.query))
    if unknown:
        raise ValueError(f"{method} {path} takes query parameters {list(r.query)}, not {unknown}")
    return r


def openapi_responses(r: Route, auth: bool, error_model: type[BaseModel]) -> dict[int | str, Any]:
    """FastAPI's `responses=` for one route: each declared error status with vLLM's error object."""
    return {
        status: {"model": error_model, "description": HTTPStatus(status).phrase}
        for status in sorted(r.error_statuses(auth))
    }


def openapi_request_body(r: Route) -> dict[str, Any] | None:
    """The `requestBody` of a route whose body the server parses by hand (strictly)."""
    if r.body is None:
        return None
    return {
        "required": r.body_required,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{r.body.__name__}"}}},
    }
