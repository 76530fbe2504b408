"""Hostile input over real HTTP: hypothesis sends well over 1000 malformed requests across every route.

Each request is malformed by construction (its kind says how), so each must get a 4xx with a message;
none may get a 5xx, stop the server, or change anything: after every request the oracle
(`engine.read_weights()`) still reads the initial weights bit for bit, the engine is on version 0 and
unpaused, no update is open, the receiver keeps its root, and nothing was generated.

    pytest suites/control/test_fuzz.py                         # 1500 requests (~10 s on 2 cores)
    WEIGHTSYNC_FUZZ_EXAMPLES=20000 pytest suites/control/test_fuzz.py
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import string

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.control import routes, schemas
from harness.control.routes import ROUTES
from suites.control.helpers import changed_tensors, request, weights_for

FUZZ_EXAMPLES = int(os.environ.get("WEIGHTSYNC_FUZZ_EXAMPLES", "1500"))
MAX_BODY = 16 << 10

# The routes come from the table the server registers (harness.control.routes.ROUTES); only a valid
# sample body per POST route is ours (test_routes.py checks that every POST route has one).
POST_ROUTES = sorted(r.path for r in ROUTES if r.method == "POST")
GET_ROUTES = sorted(r.path for r in ROUTES if r.method == "GET")
# route -> a valid body (what malformed variants are derived from; never sent as is)
VALID_BODY = {
    "/pause": {},
    "/resume": {},
    "/abort_requests": {},
    "/init_weight_transfer_engine": {"init_info": {"root": "/allowed"}},
    "/start_weight_update": {},
    "/update_weights": {"update_info": {}},
    "/finish_weight_update": {},
    "/abort_weight_update": {},
    "/shutdown_weight_transfer_engine": {},
    "/update_weight_version": {"new_version": "fuzz"},
    "/reset_prefix_cache": {},
    "/v1/completions": {"prompt": [1, 2], "max_tokens": 1},
    "/weight_checker": {"action": "checksum"},
    "/sleep": {},
    "/wake_up": {},
}
FIELDS = {
    r.path: set(r.body.model_fields) for r in ROUTES if r.body is not None and r.body is not schemas.EmptyBody
}
QUERY = {r.path: set(r.query) - set(r.query_lists) for r in ROUTES if set(r.query) - set(r.query_lists)}
BOOLEAN_QUERY = frozenset(
    {"clear_cache", "wait_for_inflight_requests", "reset_running_requests", "reset_external", "include_dp"}
)
# No update is open during the fuzz: a step out of order is refused (409) before its body is read.
LIFECYCLE_GATED = tuple(r.path for r in ROUTES if r.precondition)
KEYED = [r.path for r in ROUTES if r.keyed and not r.precondition]
REFUSED_BEFORE_ROUTING = ("oversized", "wrong method", "unknown route")
CLIENT_ERRORS = frozenset(range(400, 500))


@dataclasses.dataclass(frozen=True)
class Probe:
    kind: str
    method: str
    path: str
    content: bytes | None = None
    params: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    auth: bool = True
    expect: frozenset[int] = CLIENT_ERRORS


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _dumps(value) -> bytes:
    return json.dumps(value, allow_nan=False).encode()


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
)
json_values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=16,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=5)
post_routes = st.sampled_from(POST_ROUTES)
hostile_paths = st.sampled_from(
    [
        "/",
        "/etc",
        "/etc/passwd",
        "~",
        "~/x",
        "..",
        "../../etc",
        "relative/dir",
        "/allowed/../etc",
        "file:///etc",
        "/tmp/x\x00y",
        "\\\\server\\share",
    ]
) | st.text(max_size=30).map(lambda t: "/" + t.lstrip("/") if t else "/")
bad_labels = st.one_of(
    st.text(max_size=80).filter(lambda s: not re.fullmatch(schemas.VERSION_LABEL_PATTERN, s)),
    st.integers(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(scalars, max_size=2),
    st.none(),
)
bad_versions = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=2**63),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(scalars, max_size=2),
    st.dictionaries(st.text(max_size=3), scalars, max_size=2),
    st.text(max_size=80).filter(lambda s: not re.fullmatch(schemas.VERSION_LABEL_PATTERN, s)),
    st.sampled_from(["0", "00", "007", "9223372036854775808", "99999999999999999999"]),
)


def not_of_type(*allowed: type) -> st.SearchStrategy:
    """JSON values of none of the given Python types (bool is never an int here)."""

    def ok(v) -> bool:
        if isinstance(v, bool):
            return bool not in allowed
        return not isinstance(v, allowed)

    return json_values.filter(ok)


@st.composite
def wrong_field(draw) -> Probe:
    """One field of a body route set to a value its schema refuses."""
    path = draw(st.sampled_from(sorted(FIELDS)))
    body = dict(VALID_BODY[path])
    if path == "/start_weight_update":
        body["is_checkpoint_format"] = draw(not_of_type(bool))
    elif path in ("/init_weight_transfer_engine", "/update_weights"):
        body[next(iter(FIELDS[path]))] = draw(not_of_type(dict))
    elif path == "/finish_weight_update":
        body["weight_version"] = draw(bad_versions)
    elif path == "/update_weight_version":
        body["new_version"] = draw(bad_labels)
    elif path == "/weight_checker":
        body["action"] = draw(
            not_of_type(str) | st.text(max_size=12).filter(lambda a: a not in schemas.WEIGHT_CHECKER_ACTIONS)
        )
    elif path == "/abort_requests":
        bad_id = st.text(max_size=140).filter(lambda s: not re.fullmatch(schemas.REQUEST_ID_PATTERN, s))
        body["request_ids"] = draw(not_of_type(list, type(None)) | st.lists(bad_id, min_size=1, max_size=3))
    else:
        field = draw(
            st.sampled_from(
                [
                    "prompt",
                    "max_tokens",
                    "temperature",
                    "n",
                    "stream",
                    "stop_token_ids",
                    "request_id",
                    "model",
                    "stream_options",
                    "logprobs",
                ]
            )
        )
        body[field] = draw(
            {
                "prompt": not_of_type(list, str)
                | st.sampled_from([[], "", [""]])
                | st.lists(
                    st.integers(max_value=-1) | st.integers(min_value=2**31) | st.text(max_size=3),
                    min_size=1,
                    max_size=3,
                ).filter(lambda p: not (len(p) == 1 and isinstance(p[0], str) and p[0])),  # [text] is valid
                "max_tokens": not_of_type(int, type(None))
                | st.integers(max_value=0)
                | st.integers(min_value=schemas.MAX_NEW_TOKENS + 1),
                "temperature": not_of_type(int, float, type(None))
                | st.floats(min_value=1e-6, allow_nan=False, allow_infinity=False)
                | st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False),
                "n": not_of_type(int) | st.integers().filter(lambda n: n != 1),
                "stream": not_of_type(bool),
                "stop_token_ids": not_of_type(list, type(None))
                | st.lists(st.integers(max_value=-1), min_size=1, max_size=2),
                "request_id": not_of_type(str, type(None))
                | st.text(max_size=140).filter(lambda s: not re.fullmatch(schemas.REQUEST_ID_PATTERN, s)),
                "model": not_of_type(str, type(None))
                | st.text(min_size=1, max_size=40).filter(lambda s: s != "weightsync"),
                "stream_options": not_of_type(dict, type(None))
                | st.fixed_dictionaries({"include_usage": not_of_type(bool)}),
                "logprobs": not_of_type(int, type(None))
                | st.integers(max_value=-1)
                | st.integers(min_value=21),  # vLLM's cap (--max-logprobs 20); -1 exceeds it too
            }[field]
        )
    return Probe("wrong field", "POST", path, _dumps(body))


@st.composite
def extra_field(draw) -> Probe:
    path = draw(post_routes)
    key = draw(st.text(min_size=1, max_size=20).filter(lambda k: k not in FIELDS.get(path, ())))
    return Probe(
        "extra field",
        "POST",
        path,
        _dumps({**VALID_BODY[path], key: draw(json_values)}),
        expect=frozenset({400}),
    )


@st.composite
def not_json(draw) -> Probe:
    path = draw(post_routes)
    raw = draw(
        st.binary(min_size=1, max_size=300)
        | st.builds(lambda v, cut: _dumps(v)[: max(1, cut)], json_objects, st.integers(1, 60))
        | st.sampled_from([b'{"a": NaN}', b"{'a': 1}", b'{"a": 1,}', b"\xff\xfe{}", b"{" * 3000])
    )
    if not raw.strip() or _is_json(raw):
        raw = b"{" + raw
    if _is_json(raw) or not raw.strip():
        raw = b"{,}"
    return Probe("not json", "POST", path, raw, expect=frozenset({400}))


@st.composite
def not_an_object(draw) -> Probe:
    path = draw(post_routes)
    value = draw(json_values.filter(lambda v: not isinstance(v, dict)))
    return Probe("not an object", "POST", path, _dumps(value), expect=frozenset({400}))


@st.composite
def deep_nesting(draw) -> Probe:
    path = draw(st.sampled_from(["/init_weight_transfer_engine", "/update_weights"]))
    depth = draw(st.integers(schemas.MAX_JSON_DEPTH + 1, 2000))  # stays under MAX_BODY
    key = next(iter(FIELDS[path]))
    raw = b'{"' + key.encode() + b'": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    return Probe("deep nesting", "POST", path, raw, expect=frozenset({400}))


@st.composite
def bad_query(draw) -> Probe:
    path = draw(st.sampled_from(sorted(QUERY)) | post_routes | st.sampled_from(GET_ROUTES))
    method = "GET" if path in GET_ROUTES else "POST"
    allowed = QUERY.get(path, set())
    choices = ["unknown"] + ["mode"] * ("mode" in allowed) + ["bool"] * bool(allowed & BOOLEAN_QUERY)
    choice = draw(st.sampled_from(choices + ["repeat"] * bool(allowed)))
    if choice == "unknown":
        params = (
            (
                draw(
                    st.text(string.ascii_letters + "_", min_size=1, max_size=12).filter(
                        lambda k: k not in allowed and k not in ("tags",)
                    )
                ),
                draw(st.text(max_size=10)),
            ),
        )
    elif choice == "mode":
        params = (("mode", draw(st.text(max_size=12).filter(lambda m: m not in schemas.PAUSE_MODES))),)
    elif choice == "repeat":
        name = "mode" if "mode" in allowed else min(allowed)
        first, second = ("keep", "abort") if name == "mode" else ("true", "false")
        params = ((name, first), (name, second))
    else:
        name = draw(st.sampled_from(sorted(allowed & BOOLEAN_QUERY)))
        params = (
            (name, draw(st.text(max_size=8).filter(lambda b: b.lower() not in ("true", "false", "1", "0")))),
        )
    return Probe("bad query", method, path, params=params, expect=frozenset({400}))


@st.composite
def bad_auth(draw) -> Probe:
    path = draw(post_routes)
    header = draw(
        st.sampled_from(["", "Bearer", "Bearer x", "Basic abc", "bearer"])
        | st.text(string.printable.strip(), max_size=40).map(lambda t: "Bearer " + t)
    )
    headers = (("Authorization", header.strip()),) if draw(st.booleans()) else ()
    return Probe(
        "no or bad token",
        "POST",
        path,
        _dumps(VALID_BODY[path]),
        headers=headers,
        auth=False,
        expect=frozenset({401}),
    )


@st.composite
def bad_idempotency_key(draw) -> Probe:
    path = draw(st.sampled_from(KEYED))
    key = draw(
        st.text(string.printable.strip(), max_size=140).filter(
            lambda k: not schemas.IDEMPOTENCY_KEY_RE.match(k)
        )
    )
    params = (("mode", "keep"),) if path == "/pause" else ()
    return Probe(
        "bad idempotency key",
        "POST",
        path,
        _dumps(VALID_BODY[path]),
        params=params,
        headers=(("Idempotency-Key", key),),
        expect=frozenset({400}),
    )


@st.composite
def hostile_info(draw) -> Probe:
    """init_info / update_info whose paths, peers or manifests are hostile or malformed."""
    path = draw(st.sampled_from(["/init_weight_transfer_engine", "/update_weights"]))
    key = next(iter(FIELDS[path]))
    info = draw(json_objects)
    which = draw(st.sampled_from(["path", "peer", "manifest", "random"]))
    if which == "path":
        info[draw(st.sampled_from(["root", "path", "checkpoint_dir", "files", "location"]))] = draw(
            hostile_paths | st.lists(hostile_paths, min_size=1, max_size=2)
        )
    elif which == "peer":
        info["master_addr"] = draw(
            st.text(max_size=20).filter(lambda h: h not in ("127.0.0.1", "localhost", "::1"))
        )
    elif which == "manifest":
        info["manifest"] = draw(
            json_values
            | st.fixed_dictionaries(
                {
                    "version": json_values,
                    "bucket_sizes": st.lists(st.integers(-(2**62), 2**62), max_size=3),
                    "entries": st.lists(json_objects, max_size=3),
                }
            )
        )
    if path == "/init_weight_transfer_engine" and "root" not in info and which != "path":
        info["root"] = draw(hostile_paths)  # a well-formed init_info would legitimately re-init
    return Probe(f"hostile {key}", "POST", path, _dumps({key: info}))


@st.composite
def bad_completion_content(draw) -> Probe:
    prompt = draw(st.lists(st.integers(0, 255), max_size=4)) + [draw(st.integers(256, 2**31 - 1))]
    return Probe(
        "prompt outside the vocab",
        "POST",
        "/v1/completions",
        _dumps({"prompt": draw(st.permutations(prompt)), "max_tokens": 1}),
        expect=frozenset({400}),
    )


@st.composite
def oversized(draw) -> Probe:
    path = draw(post_routes)
    size = draw(st.integers(MAX_BODY + 1, MAX_BODY * 3))
    return Probe("oversized", "POST", path, b'{"x": "' + b"a" * size + b'"}', expect=frozenset({413}))


@st.composite
def wrong_media_type(draw) -> Probe:
    path = draw(post_routes)
    ctype = draw(
        st.sampled_from(
            [
                "text/plain",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x",
                "application/xml",
            ]
        )
    )
    return Probe(
        "wrong media type",
        "POST",
        path,
        _dumps(VALID_BODY[path]),
        headers=(("content-type", ctype),),
        expect=frozenset({415}),
    )


@st.composite
def wrong_route(draw) -> Probe:
    if draw(st.booleans()):
        path = draw(post_routes)
        return Probe("wrong method", "GET", path, expect=frozenset({405}))
    segment = draw(st.text(string.ascii_letters + string.digits + "_-.", min_size=1, max_size=20))
    path = "/" + segment
    if path in VALID_BODY or path in GET_ROUTES or path in ("/docs", "/openapi.json", "/redoc"):
        path = "/no-such-route"
    return Probe("unknown route", draw(st.sampled_from(["GET", "POST"])), path, expect=frozenset({404}))


probes = st.one_of(
    wrong_field(),
    extra_field(),
    not_json(),
    not_an_object(),
    deep_nesting(),
    bad_query(),
    bad_auth(),
    bad_idempotency_key(),
    hostile_info(),
    bad_completion_content(),
    oversized(),
    wrong_media_type(),
    wrong_route(),
)


def fuzz(served, examples: int, seen: collections.Counter[str], statuses: collections.Counter[int]) -> None:
    """Send `examples` malformed requests to `served` (started with max_body_bytes=MAX_BODY); fail on the
    first answer that is not a 4xx the route table declares, with a message, or that changed anything.
    Counts the probe kinds sent in `seen` and the statuses answered in `statuses`."""
    receiver_root = served.receiver.root
    baseline = served.engine.read_weights()
    http = httpx.Client(base_url=served.url, timeout=30)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(probe=probes)
    def one(probe: Probe) -> None:
        headers = dict(probe.headers)
        if probe.auth:
            headers.setdefault("Authorization", f"Bearer {served.token}")
            if probe.content is not None:
                headers.setdefault("content-type", "application/json")
        resp = http.request(
            probe.method, probe.path, content=probe.content, params=list(probe.params), headers=headers
        )
        seen[probe.kind] += 1
        statuses[resp.status_code] += 1
        shown = f"{probe.kind}: {probe.method} {probe.path} params={probe.params} body={(probe.content or b'')[:200]!r}"
        expect = probe.expect
        if probe.path in LIFECYCLE_GATED and probe.auth and probe.kind not in REFUSED_BEFORE_ROUTING:
            expect = frozenset({409})
        assert resp.status_code in expect, (
            f"{shown}\n-> {resp.status_code}, expected {sorted(expect)[:6]}: {resp.text[:300]}"
        )
        route = routes.find(probe.method, probe.path)
        if route is not None:  # every answer is one the route table declares (and /openapi.json lists)
            declared = route.error_statuses(auth=True)
            assert resp.status_code in declared, (
                f"{shown}\n-> {resp.status_code}, which routes.ROUTES does not declare for {probe.path} "
                f"({sorted(declared)}): {resp.text[:300]}"
            )
        error = resp.json().get("error", {})
        assert error.get("message"), f"{shown}\n-> {resp.status_code} without a message: {resp.text[:300]}"
        problems = changed_tensors(baseline, served.engine.read_weights())
        assert not problems, f"{shown}\n-> changed the weights: {problems[:3]}"
        state = (
            served.engine.weight_version,
            served.engine.is_paused,
            served.receiver.state,
            served.receiver.root,
        )
        assert state == (0, False, "ready", receiver_root), (
            f"{shown}\n-> changed the engine/receiver state to {state}"
        )
        info = served.server.weight_status()
        assert (info["weight_version"], info["update_in_progress"]) == ("default", False), (
            f"{shown}\n-> weight_info {info}"
        )
        assert served.server.counters["submitted"] == 0, f"{shown}\n-> a completion reached the engine"

    try:
        one()
    finally:
        http.close()


def test_malformed_requests_get_4xx_and_change_nothing(make_served, record_property):
    served = make_served(max_body_bytes=MAX_BODY)
    seen: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[int] = collections.Counter()
    try:
        fuzz(served, FUZZ_EXAMPLES, seen, statuses)
    finally:
        record_property("fuzz_requests", sum(seen.values()))
        record_property("fuzz_kinds", dict(seen))
        record_property("fuzz_statuses", dict(statuses))
        print(
            f"fuzz: {sum(seen.values())} requests; kinds {dict(seen)}; statuses {dict(sorted(statuses.items()))}"
        )
    assert sum(seen.values()) >= min(1000, FUZZ_EXAMPLES), (
        f"only {sum(seen.values())} malformed requests were sent: {dict(seen)}"
    )
    assert not [s for s in statuses if s >= 500], f"5xx answers: {dict(statuses)}"
    w = weights_for(served.engine, seed=1)
    served.push(1, w)  # and the server still does its job
    c = served.client.complete(request(3, "after-fuzz"))
    assert (len(c.token_ids), c.versions_seen) == (3, {1}), f"after fuzzing: {c}"
