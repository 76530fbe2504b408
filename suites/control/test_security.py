"""Security beyond vLLM's dev routes (which have no auth): bearer token on every mutating route,
loopback by default, bounded bodies, strict schemas, validated versions, and file paths confined to
the allowed directory. Every refusal is a 4xx with a message, and the server keeps serving the last
committed version bit for bit."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from harness.checks import assert_bitwise_equal
from harness.control.app import ServerThread
from harness.control.server import ControlServer, ServerConfig, token_from_environment
from harness.engines.reference import ReferenceEngine
from harness.paths.disk import DiskReceiver
from suites.control.helpers import beyond_vllm, clean_env, request, require_route, start_cli, weights_for

MUTATING = {
    "/pause": {"params": {"mode": "keep"}},
    "/resume": {},
    "/abort_requests": {},
    "/init_weight_transfer_engine": {"json": {"init_info": {"root": "/tmp"}}},
    "/start_weight_update": {},
    "/update_weights": {"json": {"update_info": {}}},
    "/finish_weight_update": {"json": {"weight_version": "1"}},
    "/abort_weight_update": {},
    "/shutdown_weight_transfer_engine": {},
    "/update_weight_version": {"json": {"new_version": "stolen"}},
    "/reset_prefix_cache": {},
    "/v1/completions": {"json": {"prompt": [1, 2], "max_tokens": 2}},
    "/sleep": {"params": {"level": "1"}},
    "/wake_up": {},
    "/weight_checker": {"json": {"action": "reset"}},
}
READ_ONLY = [
    "/is_paused", "/weight_info", "/weight_status", "/weight_spec", "/stats", "/health", "/is_sleeping",
    "/get_world_size",
]  # fmt: skip


def bad_authorizations(token: str) -> list[dict[str, str]]:
    return [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer wrong-token-wrong-token"},
        {"Authorization": f"Bearer {token[:-1]}"},
        {"Authorization": f"Bearer  {token}"},
        {"Authorization": f"bearer {token}"},
        {"Authorization": f"Basic {token}"},
        {"Authorization": token},
    ]


def assert_untouched(served, weights, label="default", version=0) -> None:
    """The engine serves `version` with `weights`, unpaused, no update open, nothing generated (a
    foreign server: the label vLLM's /weight_info gives, the weights through its oracle)."""
    if served.foreign is not None:  # vLLM's API has no engine version and no open-update flag
        info = served.client.weight_info()
        assert info["weight_version"] == label, info
    else:
        info = served.client.weight_status()
        assert (info["weight_version"], info["engine_version"], info["update_in_progress"]) == (
            label,
            version,
            False,
        ), info
    assert not served.engine.is_paused, "a refused request paused the engine"
    assert_bitwise_equal(weights, served.engine.read_weights(), "after refused requests")


def assert_refused(resp: httpx.Response, status: int, fragment: str = "") -> None:
    assert resp.status_code == status, (
        f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text[:300]}"
    )
    message = resp.json()["error"]["message"]
    assert fragment.lower() in message.lower(), f"error {message!r} does not say {fragment!r}"


# --------------------------------------------------------------------------------------------- auth
@pytest.mark.parametrize("path", sorted(MUTATING))
def test_mutating_route_needs_the_bearer_token(served, path):
    require_route(served, "POST", path)
    before = served.engine.read_weights()
    for headers in bad_authorizations(served.token):
        resp = httpx.post(served.url + path, headers=headers, **MUTATING[path])
        assert_refused(resp, 401, "bearer token")
        assert resp.headers.get("www-authenticate") == "Bearer", resp.headers
    assert_untouched(served, before)
    assert served.client.stats()["submitted"] == 0, "an unauthenticated completion reached the engine"


def test_read_only_routes_need_no_token(served):
    foreign = served.foreign is not None  # a foreign server is asked for vLLM's routes only
    for path in [p for p in READ_ONLY if not (foreign and beyond_vllm("GET", p))]:
        resp = httpx.get(served.url + path)
        assert resp.status_code == 200, f"GET {path}: {resp.status_code} {resp.text[:200]}"


def test_binds_loopback_by_default(served):
    assert ServerConfig(token="x" * 16).host == "127.0.0.1"
    bound = served.thread._uvicorn.servers[0].sockets[0].getsockname()
    assert bound[0] == "127.0.0.1", f"server bound {bound}"


@pytest.mark.parametrize("token", ["", "short", 123])
def test_a_given_token_must_be_a_long_string(token):
    with pytest.raises(ValueError, match="token"):
        ServerConfig(token=token)  # type: ignore[arg-type]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.org", ""])
def test_no_token_on_a_non_loopback_address_refuses_to_start(host):
    with pytest.raises(ValueError, match=r"(?s)token.*WEIGHTSYNC_CONTROL_TOKEN.*VLLM_API_KEY"):
        ServerConfig(token=None, host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "localhost", "::1"])
def test_no_token_on_loopback_turns_auth_off(host):
    assert ServerConfig(token=None, host=host).auth is False
    assert ServerConfig(token="t" * 16, host=host).auth is True


def test_loopback_without_a_token_serves_unauthenticated_and_says_so_at_start(tmp_path, caplog):
    engine = ReferenceEngine(max_batch=2)
    cfg = ServerConfig(token=None, allowed_dirs=(tmp_path,))
    with caplog.at_level(logging.WARNING, logger="weightsync.control"):
        thread = ServerThread(ControlServer(engine, DiskReceiver(engine), cfg)).start()
    try:
        said = [r.getMessage() for r in caplog.records if "authentication is off" in r.getMessage()]
        assert said and thread.url in said[0], f"no start-up line says auth is off: {caplog.text[-500:]}"
        assert httpx.post(thread.url + "/resume").status_code == 200
        assert "securitySchemes" not in httpx.get(thread.url + "/openapi.json").json()["components"]
    finally:
        thread.stop()
        engine.shutdown()


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, None),
        ({"WEIGHTSYNC_CONTROL_TOKEN": "w" * 16}, "w" * 16),
        ({"VLLM_API_KEY": "v" * 16}, "v" * 16),
        ({"WEIGHTSYNC_CONTROL_TOKEN": "w" * 16, "VLLM_API_KEY": "v" * 16}, "w" * 16),
        ({"WEIGHTSYNC_CONTROL_TOKEN": "", "VLLM_API_KEY": "v" * 16}, "v" * 16),
    ],
)
def test_the_token_is_read_from_the_environment(environ, expected):
    assert token_from_environment(environ) == expected


def _cli(args, env, tmp_path):
    return [sys.executable, "-m", "harness.control.app", "--allowed-dir", str(tmp_path), *args], env


def test_cli_refuses_a_non_loopback_address_without_a_token(tmp_path):
    cmd, env = _cli(["--host", "0.0.0.0"], clean_env(), tmp_path)
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2, (refused.returncode, refused.stderr[-500:])
    assert "0.0.0.0" in refused.stderr and "WEIGHTSYNC_CONTROL_TOKEN" in refused.stderr, refused.stderr[-500:]


def test_cli_on_loopback_without_a_token_says_auth_is_off(tmp_path):
    proc, lines, url, _ = start_cli([], clean_env(), tmp_path)
    try:
        assert url.startswith("http://127.0.0.1:"), lines
        assert any("authentication is off" in line for line in lines), f"CLI said {lines}"
        assert httpx.post(url + "/resume").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("variable", ["WEIGHTSYNC_CONTROL_TOKEN", "VLLM_API_KEY"])
def test_cli_takes_the_token_from_the_environment(tmp_path, variable):
    token = "cli-token-0123456789abcdef"
    proc, lines, url, _ = start_cli([], {**clean_env(), variable: token}, tmp_path)
    try:
        assert url.startswith("http://127.0.0.1:"), f"CLI said {lines}"
        assert not any("authentication is off" in line for line in lines), lines
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/resume").status_code == 401
        assert httpx.post(url + "/resume", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


# --------------------------------------------------------------------------------------------- size
def test_oversized_bodies_are_refused_before_parsing(make_served):
    served = make_served(max_body_bytes=4096)
    before = served.engine.read_weights()
    big = b'{"update_info": {"pad": "' + b"x" * 5000 + b'"}}'
    declared = httpx.post(
        served.url + "/update_weights",
        content=big,
        headers={**served.auth(), "content-type": "application/json"},
    )
    assert_refused(declared, 413, "limit")
    chunked = httpx.post(
        served.url + "/update_weights", content=iter([big[:3000], big[3000:]]), headers=served.auth()
    )
    assert_refused(chunked, 413, "limit")
    assert_untouched(served, before)
    served.push(1, weights_for(served.engine, seed=1))


# --------------------------------------------------------------------------------------------- schemas
STRICT_CASES = [
    # (path, query, raw body or JSON, status, message fragment)
    ("/start_weight_update", None, {"is_checkpoint_format": True, "extra": 1}, 400, "extra"),
    ("/start_weight_update", None, {"is_checkpoint_format": "true"}, 400, "boolean"),
    ("/init_weight_transfer_engine", None, {"init_info": {}, "rank": 1}, 400, "extra"),
    ("/init_weight_transfer_engine", None, {}, 400, "init_info"),
    # no update is open: the order is refused before the body is read (test_vllm_routes covers the body)
    ("/update_weights", None, {"update_info": []}, 409, "start_weight_update"),
    ("/update_weights", None, None, 409, "start_weight_update"),
    ("/abort_requests", None, {"request_ids": "abc"}, 400, "array"),
    ("/abort_requests", None, {"request_ids": ["../x"]}, 400, "pattern"),
    ("/resume", {"now": "1"}, None, 400, "unknown query"),
    ("/pause", {"mode": "sleep"}, None, 400, "mode"),
    ("/pause", {"mode": "keep", "clear_cache": "maybe"}, None, 400, "not a boolean"),
    ("/pause", [("mode", "keep"), ("mode", "abort")], None, 400, "2 times"),
    ("/reset_prefix_cache", {"reset_external": "yes"}, None, 400, "not a boolean"),
    ("/v1/completions", None, {"prompt": ["hello", "world"], "max_tokens": 2}, 400, "at most 1"),
    ("/v1/completions", None, {"prompt": [], "max_tokens": 2}, 400, "at least 1"),
    ("/v1/completions", None, {"prompt": [-1], "max_tokens": 2}, 400, "greater than or equal"),
    ("/v1/completions", None, {"prompt": [300], "max_tokens": 2}, 400, "outside vocab"),
    ("/v1/completions", None, {"prompt": [1], "max_tokens": "3"}, 400, "integer"),
    ("/v1/completions", None, {"prompt": [1], "max_tokens": 0}, 400, "greater than or equal"),
    ("/v1/completions", None, {"prompt": [1], "temperature": 0.7}, 400, "less than or equal"),
    ("/v1/completions", None, {"prompt": [1], "n": 2}, 400, "less than or equal"),
    ("/v1/completions", None, {"prompt": [1], "echo": True}, 400, "extra"),
    ("/v1/completions", None, {"prompt": [1], "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", None, b'{"prompt": [1], "temperature": NaN}', 400, "finite"),
    ("/v1/completions", None, b'{"prompt": [1', 400, "json"),
    ("/v1/completions", None, b"[" * 5000 + b"]" * 5000, 400, "recursion"),
    ("/update_weight_version", None, b"\xff\xfe\x00", 400, "json"),
]


@pytest.mark.parametrize(
    ("path", "query", "body", "status", "fragment"), STRICT_CASES, ids=lambda v: str(v)[:30]
)
def test_strict_schemas_refuse_with_a_message(served, path, query, body, status, fragment):
    before = served.engine.read_weights()
    kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    headers = (
        {**served.auth(), "content-type": "application/json"} if isinstance(body, bytes) else served.auth()
    )
    assert_refused(httpx.post(served.url + path, params=query, headers=headers, **kwargs), status, fragment)
    assert_untouched(served, before)


def test_wrong_content_type_is_refused(served):
    resp = httpx.post(
        served.url + "/update_weight_version",
        content=b'{"new_version": "v2"}',
        headers={**served.auth(), "content-type": "text/plain"},
    )
    assert_refused(resp, 415, "application/json")


# --------------------------------------------------------------------------------------------- versions
@pytest.mark.parametrize(
    ("version", "status"),
    [
        ("../../etc/passwd", 400),
        ("a b", 400),
        ("", 400),
        ("x" * 65, 400),
        ("007", 400),
        ("0", 400),
        ("9223372036854775808", 400),
        (0, 400),
        (-1, 400),
        (2**63, 400),
        (True, 400),
        (1.0, 400),
        ([1], 400),
    ],
    ids=repr,
)
def test_version_strings_are_validated(served, version, status):
    served.client.start_weight_update()  # inside an update, so the body is what gets judged
    resp = httpx.post(
        served.url + "/finish_weight_update", json={"weight_version": version}, headers=served.auth()
    )
    assert resp.status_code == status, f"weight_version={version!r}: {resp.status_code} {resp.text[:300]}"
    assert resp.json()["error"]["param"] == "body.weight_version", resp.text[:300]
    assert served.client.weight_version() == "default", "a refused finish relabelled the served version"
    if served.foreign is None:  # vLLM's API has a label only
        assert served.client.weight_status()["engine_version"] == 0


@pytest.mark.parametrize(
    "label", ["../../etc/passwd", "a b", "", "-x", "x" * 65, "v1\n", 7, None, True, ["v1"]], ids=repr
)
def test_version_labels_are_validated(served, label):
    resp = httpx.post(
        served.url + "/update_weight_version", json={"new_version": label}, headers=served.auth()
    )
    assert resp.status_code == 400, f"new_version={label!r}: {resp.status_code} {resp.text[:300]}"
    assert resp.json()["error"]["param"] == "body.new_version", resp.text[:300]
    assert served.client.weight_version() == "default"


# --------------------------------------------------------------------------------------------- paths
@pytest.fixture
def outside_checkpoint(served, tmp_path):
    """A genuine checkpoint of version 1, copied outside the allowed directory; and its update_info."""
    info = served.deployment.sender.prepare(1, weights_for(served.engine, seed=1))
    outside = tmp_path / "outside"
    shutil.copytree(info["path"], outside / "v1")
    return info, outside / "v1"


def _path_cases(served, outside):
    root = served.root
    (root / "link").symlink_to(outside, target_is_directory=True)
    return {
        "traversal": str(root / ".." / "outside" / "v1"),
        "absolute outside": str(outside),
        "symlink out of the root": str(root / "link"),
        "relative": os.path.relpath(outside),
        "home": "~/v1",
        "nul byte": str(root) + "\x00/v1",
        "system file": "/etc/passwd",
    }


def test_update_paths_outside_the_allowed_directory_are_refused(served, outside_checkpoint):
    info, outside = outside_checkpoint
    before = served.engine.read_weights()
    for what, path in _path_cases(served, outside).items():
        served.client.start_weight_update()
        resp = httpx.post(
            served.url + "/update_weights",
            json={"update_info": {**info, "path": path}},
            headers=served.auth(),
        )
        assert resp.status_code == 400, f"{what} path {path!r}: {resp.status_code} {resp.text[:300]}"
        assert "path" in resp.json()["error"]["message"], resp.text
        assert resp.json()["error"]["type"] == "Bad Request", f"not vLLM's 400 type: {resp.text[:300]}"
        served.client.abort_weight_update()
        assert_untouched(served, before)
    for smuggled in (
        {"paths": [info["path"], str(outside)]},
        {"location": str(outside)},
        {"extra": {"file": "/etc/passwd"}},
    ):
        served.client.start_weight_update()
        resp = httpx.post(
            served.url + "/update_weights", json={"update_info": {**info, **smuggled}}, headers=served.auth()
        )
        assert resp.status_code == 400, f"{smuggled}: {resp.status_code} {resp.text[:300]}"
        served.client.abort_weight_update()
    assert_untouched(served, before)
    served.push(1, weights_for(served.engine, seed=1))
    assert served.engine.weight_version == 1, "the server stopped serving updates after refused paths"


@pytest.mark.parametrize(
    "init_info",
    [
        {"root": "/"},
        {"root": "{root}/.."},
        {"root": "relative/dir"},
        {"root": "{root}", "master_addr": "10.1.2.3"},
    ],
    ids=["fs-root", "parent", "relative", "foreign-peer"],
)
def test_init_info_is_confined_too(served, init_info):
    info = {k: v.replace("{root}", str(served.root)) for k, v in init_info.items()}
    resp = httpx.post(
        served.url + "/init_weight_transfer_engine", json={"init_info": info}, headers=served.auth()
    )
    assert resp.status_code == 400, f"init_info {info}: {resp.status_code} {resp.text[:300]}"
    w = weights_for(served.engine, seed=1)
    served.push(1, w)  # the receiver kept its root
    assert_bitwise_equal(w, served.engine.read_weights(), "push after a refused init_info")


def test_server_keeps_serving_after_hostile_input(served):
    for path in MUTATING:
        httpx.post(served.url + path, content=b"\x00" * 100, headers=served.auth())
    w = weights_for(served.engine, seed=3)
    served.push(1, w)
    assert_bitwise_equal(w, served.engine.read_weights(), "push after garbage on every route")
    c = served.client.complete(request(3, "after-garbage"))
    assert (len(c.token_ids), c.versions_seen) == (3, {1}), c


def test_cli_serves_the_model_name_it_is_given(tmp_path):
    """vLLM's clients name the model they started the server with (`--served-model-name m`)."""
    proc, _, url, _ = start_cli(["--served-model-name", "m"], clean_env(), tmp_path)
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        named = httpx.post(url + "/v1/completions", json={**body, "model": "m"}, timeout=30)
        other = httpx.post(url + "/v1/completions", json={**body, "model": "weightsync"}, timeout=30)
        assert named.status_code == 200 and named.json()["model"] == "m", named.text[:300]
        assert other.status_code == 404 and other.json()["error"]["type"] == "NotFoundError", other.text[:300]
    finally:
        proc.terminate()
        proc.wait(30)
