"""The vLLM API levels of the control server (`ServerConfig.vllm_api`, `--vllm-api`): "0.32", the
default, and "rfc45585", the routes of vLLM's RL CI-matrix prototype (RFC #45585) that 0.32 lacks:
GET /weight_update_active, POST /update_weight_label, `weight_gen` and `weight_label` in /weight_info
and in the finish, the state machine's 409 for a double start, 500 for a start before init.

vLLM main's RL router (vllm/entrypoints/rl/online/api_router.py) has none of these routes; RFC #48306
records the /weight_info and /update_weight_label prototypes as "not upstreamed to vLLM main". So the
level is named after the RFC, not "main" (`--vllm-api main` is refused, saying so).

The `test_vllm_*` tests at the end transcribe vLLM's own tests of that prototype (the class and test
each mirrors is named in its docstring), run against this server at level rfc45585; vLLM's tests start
a server per test, as the `served` fixture does. suites/control/README.md has the table."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from harness.control import routes
from harness.control.server import ServerConfig
from suites.control.helpers import clean_env, request, start_cli, weights_for
from suites.control.test_vllm_routes import assert_error, get, post, stage

LEVEL = "rfc45585"
NEW_ROUTES = {("GET", "/weight_update_active"), ("POST", "/update_weight_label")}


def uninit(served) -> None:
    """Back to a server nobody has initialised (the fixture's deployment inits it): vLLM's tests run
    against a fresh server and never call /init_weight_transfer_engine."""
    assert post(served, "/shutdown_weight_transfer_engine").status_code == 200


def init(served) -> None:
    """Initialise with the fixture deployment's init_info again, so `served.push` works."""
    resp = post(served, "/init_weight_transfer_engine", json={"init_info": served.deployment.init_info})
    assert resp.status_code == 200, resp.text[:300]


@pytest.fixture
def proto(make_served):
    """A server at the prototype's level, not initialised (as vLLM's tests find theirs)."""
    served = make_served(vllm_api=LEVEL)
    uninit(served)
    return served


def active(served) -> bool:
    resp = get(served, "/weight_update_active")
    assert resp.status_code == 200, resp.text[:300]
    body = resp.json()
    assert set(body) == {"weight_update_active"} and isinstance(body["weight_update_active"], bool), body
    return body["weight_update_active"]


def info(served) -> dict:
    resp = get(served, "/weight_info")
    assert resp.status_code == 200, resp.text[:300]
    return resp.json()


def unknown_tensor(update_info: dict) -> dict:
    """The same part, one tensor renamed to a name the engine lacks: the receiver refuses it (422)."""
    manifest = update_info["manifest"]
    entries = [{**manifest["entries"][0], "name": "no.such.tensor"}, *manifest["entries"][1:]]
    return {**update_info, "manifest": {**manifest, "entries": entries}}


def generates(served) -> bool:
    return served.client.submit(request(3)).result(timeout=30).finish_reason == "length"


# --------------------------------------------------------------------------------------------- the setting
@pytest.mark.parametrize("level", routes.VLLM_API_LEVELS)
def test_each_level_serves_exactly_its_table_and_documents_it(make_served, level):
    served = make_served(vllm_api=level)
    table = routes.table(level)
    served_routes = {
        (method, r.path)
        for r in served.server.app.routes
        if r.path not in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect")
        for method in getattr(r, "methods", ()) - {"HEAD"}
    }
    assert served_routes == {(r.method, r.path) for r in table}
    assert (served_routes >= NEW_ROUTES) == (level == LEVEL), sorted(served_routes)
    doc = httpx.get(served.url + "/openapi.json").json()
    for r in table:
        operation = doc["paths"][r.path][r.method.lower()]
        documented = {int(s) for s in operation["responses"] if not s.startswith("2")}
        assert documented == set(r.error_statuses(auth=True)), (r.path, sorted(documented))
        if r.body is not None:
            assert operation["requestBody"] == routes.openapi_request_body(r), r.path
    start = doc["paths"]["/start_weight_update"]["post"]["responses"]
    assert ("500" in start) == (level == LEVEL), "only rfc45585 declares its start-before-init 500"


def test_the_default_level_is_0_32_and_unchanged():
    assert ServerConfig(token=None).vllm_api == "0.32" == routes.DEFAULT_VLLM_API
    assert routes.table() == routes.ROUTES, "the default level's table must be ROUTES, unchanged"


def test_at_0_32_the_prototype_routes_and_fields_are_absent(served):
    assert get(served, "/weight_update_active").status_code == 404
    assert post(served, "/update_weight_label", json={"weight_label": "step-0"}).status_code == 404
    assert info(served) == {"weight_version": "default"}
    uninit(served)
    assert_error(post(served, "/start_weight_update"), 409, "LifecycleError", None, "init")
    info_, _ = stage(served, 1, seed=1)
    assert post(served, "/update_weights", json={"update_info": info_}).status_code == 200
    labelled = post(served, "/finish_weight_update", json={"weight_version": "1", "weight_label": "s"})
    assert_error(labelled, 400, "Bad Request", "body.weight_label", "extra")
    finish = post(served, "/finish_weight_update", json={"weight_version": "1"}).json()
    assert finish == {"message": "Weight update finished", "weight_version": "1", "already_committed": False}
    assert "weight_gen" not in get(served, "/weight_status").json()


@pytest.mark.parametrize("level", ["main", "nightly", "0.33", ""])
def test_an_unknown_level_is_refused_and_main_is_explained(level):
    with pytest.raises(ValueError, match=r"0\.32.*rfc45585") as refused:
        ServerConfig(token=None, vllm_api=level)
    if level in ("main", "nightly"):
        assert "not merged into main" in str(refused.value), refused.value


def test_cli_serves_the_level_it_is_given_and_refuses_main(tmp_path):
    proc, lines, url, _ = start_cli(["--vllm-api", LEVEL], clean_env(), tmp_path)
    try:
        assert any(f"vLLM API level {LEVEL}" in line for line in lines), lines
        assert httpx.get(url + "/weight_update_active").json() == {"weight_update_active": False}
        assert httpx.get(url + "/weight_info").json() == {"weight_gen": 0, "weight_label": ""}
    finally:
        proc.terminate()
        proc.wait(30)
    refused = subprocess.run(
        [sys.executable, "-m", "harness.control.app", "--vllm-api", "main"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "rfc45585" in refused.stderr, refused.stderr[-600:]


# --------------------------------------------------------------------------------------------- /weight_update_active
def test_weight_update_active_follows_the_update_from_start_to_finish_or_abort(proto):
    assert active(proto) is False
    info_, _ = stage(proto, 1, seed=1)  # init + start
    assert active(proto) is True
    assert post(proto, "/update_weights", json={"update_info": info_}).status_code == 200
    assert active(proto) is True
    assert post(proto, "/finish_weight_update").status_code == 200
    assert active(proto) is False
    assert post(proto, "/start_weight_update").status_code == 200
    assert active(proto) is True
    assert post(proto, "/abort_weight_update").status_code == 200  # ours: vLLM has no abort
    assert active(proto) is False


def test_an_update_stays_active_after_a_refused_part_and_a_refused_finish(proto):
    info_, _ = stage(proto, 2, seed=1)
    assert post(proto, "/update_weights", json={"update_info": info_}).status_code == 200
    wrong = post(proto, "/finish_weight_update", json={"weight_version": "3"})
    assert_error(wrong, 409, "VersionError", None)
    assert active(proto) is True, "a finish refused for its version leaves the update open"
    assert post(proto, "/update_weights", json={"update_info": unknown_tensor(info_)}).status_code == 422
    assert active(proto) is True, "a refused part leaves the update open until finish or abort"
    assert_error(post(proto, "/finish_weight_update"), 409, "LifecycleError", None, "refused")
    assert active(proto) is False, "the finish that refuses a failed update closes it"


# --------------------------------------------------------------------------------------------- status codes
def test_start_before_init_is_vllms_500_with_its_error_object(proto):
    resp = post(proto, "/start_weight_update")
    assert_error(resp, 500, "InternalServerError", None, "weight transfer not configured")
    assert "init_weight_transfer_engine" in resp.json()["error"]["message"]
    assert active(proto) is False
    assert generates(proto)


def test_a_double_start_is_409_even_after_a_refused_part(make_served):
    """0.32 (ours) lets a start replace an update whose part was refused; the prototype's state machine
    keeps it open until finish, so a second start is 409 there."""
    for level, restart in (("0.32", 200), (LEVEL, 409)):
        served = make_served(vllm_api=level)
        info_, _ = stage(served, 1, seed=1)
        assert_error(post(served, "/start_weight_update"), 409, "LifecycleError", None, "in progress")
        assert post(served, "/update_weights", json={"update_info": unknown_tensor(info_)}).status_code == 422
        assert post(served, "/start_weight_update").status_code == restart, level
    assert post(served, "/abort_weight_update").status_code == 200
    assert post(served, "/start_weight_update").status_code == 200, "abort closes it, as finish does"


@pytest.mark.parametrize("path", ["/update_weights", "/finish_weight_update"])
def test_update_and_finish_without_start_are_409_before_and_after_init(proto, path):
    body = (
        {"update_info": {"names": [], "dtype_names": [], "shapes": []}} if path == "/update_weights" else None
    )
    assert_error(post(proto, path, json=body), 409, "LifecycleError", None, "start_weight_update")
    stage(proto, 1, seed=1)
    assert post(proto, "/abort_weight_update").status_code == 200
    assert_error(post(proto, path, json=body), 409, "LifecycleError", None, "start_weight_update")
    assert generates(proto)


# --------------------------------------------------------------------------------------------- weight_gen / weight_label
def test_weight_info_is_exactly_gen_and_label_and_a_label_never_bumps_gen(proto):
    assert info(proto) == {"weight_gen": 0, "weight_label": ""}
    for label in ("step-0", "checkpoint/final"):
        resp = post(proto, "/update_weight_label", json={"weight_label": label})
        assert resp.json() == {"weight_gen": 0, "weight_label": label}, resp.text[:300]
    assert info(proto) == {"weight_gen": 0, "weight_label": "checkpoint/final"}


def test_every_committed_finish_bumps_gen_by_one_whatever_the_version(proto):
    """weight_gen counts finishes, not version numbers: versions 1 and 5 are gens 1 and 2."""
    info_, tensors = stage(proto, 1, seed=1)
    assert post(proto, "/update_weights", json={"update_info": info_}).status_code == 200
    first = post(proto, "/finish_weight_update", json={"weight_version": "1", "weight_label": "step-1"})
    assert first.json() == {
        "message": "Weight update finished",
        "weight_gen": 1,
        "weight_label": "step-1",
        "weight_version": "1",  # ours, as at 0.32
        "already_committed": False,
    }, first.text[:300]
    init(proto)
    proto.push(5, weights_for(proto.engine, seed=5))  # the harness's client: finish without a label
    assert info(proto) == {"weight_gen": 2, "weight_label": "step-1"}, "a finish without a label keeps it"
    status = get(proto, "/weight_status").json()
    assert (status["engine_version"], status["weight_gen"], status["weight_label"]) == (5, 2, "step-1")


def test_retried_and_refused_finishes_do_not_bump_gen(proto):
    info_, _ = stage(proto, 1, seed=1)
    assert post(proto, "/update_weights", json={"update_info": info_}).status_code == 200
    key = {"Idempotency-Key": "finish-key-0001"}
    body = {"weight_version": "1", "weight_label": "a"}
    first = httpx.post(proto.url + "/finish_weight_update", json=body, headers={**proto.auth(), **key})
    replay = httpx.post(proto.url + "/finish_weight_update", json=body, headers={**proto.auth(), **key})
    assert first.json() == replay.json() and first.json()["weight_gen"] == 1, (first.text, replay.text)
    again = post(proto, "/finish_weight_update", json={"weight_version": "1", "weight_label": "b"})
    assert again.json()["already_committed"] is True and again.json()["weight_gen"] == 1, again.text
    assert info(proto) == {"weight_gen": 1, "weight_label": "a"}, "a recognised retry changed gen or label"
    info_, _ = stage(proto, 2, seed=2)
    assert post(proto, "/update_weights", json={"update_info": info_}).status_code == 200
    assert (
        post(proto, "/finish_weight_update", json={"weight_version": "3", "weight_label": "c"}).status_code
        == 409
    )
    assert info(proto) == {"weight_gen": 1, "weight_label": "a"}, "a refused finish changed gen or label"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/update_weight_label", {"weight_label": 5}, "body.weight_label"),
        ("/update_weight_label", {"weight_label": "two words"}, "body.weight_label"),
        ("/update_weight_label", {"weight_label": ""}, "body.weight_label"),
        ("/update_weight_label", {"label": "x"}, "body.weight_label"),
        ("/finish_weight_update", {"weight_label": ["x"]}, "body.weight_label"),
    ],
    ids=str,
)
def test_labels_are_validated_as_every_label_is(proto, path, body, param):
    stage(proto, 1, seed=1)
    assert_error(post(proto, path, json=body), 400, "Bad Request", param)
    assert info(proto) == {"weight_gen": 0, "weight_label": ""}
    assert active(proto) is True, "a refused finish body left the update open"


def test_update_weight_label_needs_the_token(proto):
    resp = httpx.post(proto.url + "/update_weight_label", json={"weight_label": "x"}, timeout=30)
    assert resp.status_code == 401 and info(proto)["weight_label"] == ""
    assert httpx.get(proto.url + "/weight_update_active", timeout=30).status_code == 200, "GETs need none"


def test_the_harness_client_pushes_at_the_prototype_level(proto):
    init(proto)
    proto.push(1, weights_for(proto.engine, seed=7))
    assert proto.engine.weight_version == 1 and info(proto)["weight_gen"] == 1
    assert proto.deployment.handles[0].engine.weight_version == 1  # read through /weight_status


# --------------------------------------------------------------------------------------------- vLLM's own tests
# tests/entrypoints/serve/dev/rlhf/test_state_machine_enforcement.py (vLLM, RFC #45585)
def test_vllm_state_machine_active_endpoint(proto):
    """TestStateMachineActiveEndpoint.test_inactive_at_startup, .test_active_after_start;
    TestWeightUpdateActiveSchema.test_returns_bool_field, .test_initial_value_is_false."""
    assert active(proto) is False
    r = post(proto, "/start_weight_update", json={})
    assert r.status_code == 500  # no init: vLLM's test allows 200 or 500 and reads the flag after a 200
    assert active(proto) is False
    stage(proto, 1, seed=1)
    assert active(proto) is True
    post(proto, "/finish_weight_update")


def test_vllm_state_machine_double_start_returns_409(proto):
    """TestStateMachineDoubleStart.test_double_start_returns_409 (the branch where the first start is
    200, which needs an init here)."""
    stage(proto, 1, seed=1)
    r2 = post(proto, "/start_weight_update", json={})
    assert r2.status_code == 409, r2.text[:300]
    assert get(proto, "/health").status_code == 200


def test_vllm_state_machine_finish_without_start_returns_409(proto):
    """TestStateMachineFinishWithoutStart.test_finish_without_start_returns_409,
    .test_engine_healthy_after_ordering_violation."""
    assert post(proto, "/finish_weight_update").status_code == 409
    assert get(proto, "/health").status_code == 200
    assert generates(proto)


def test_vllm_state_machine_update_weights_without_start_returns_409(proto):
    """TestStateMachineUpdateWeightsWithoutStart.test_update_without_start_returns_409,
    .test_engine_healthy_after_update_ordering_violation (their body: empty names, dtype_names, shapes)."""
    body = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    assert post(proto, "/update_weights", json=body).status_code == 409
    assert get(proto, "/health").status_code == 200
    assert generates(proto)


# tests/entrypoints/serve/dev/rlhf/test_weight_info.py (vLLM, RFC #45585)
def test_vllm_weight_info_endpoint(proto):
    """TestWeightInfoEndpoint.test_initial_weight_gen_is_zero, .test_weight_info_schema: exactly
    weight_gen (int, 0) and weight_label (str, "")."""
    body = info(proto)
    assert body == {"weight_gen": 0, "weight_label": ""}
    assert isinstance(body["weight_gen"], int) and isinstance(body["weight_label"], str)


def test_vllm_update_weight_label(proto):
    """TestUpdateWeightLabel.test_set_label_preserves_gen, .test_label_can_be_overwritten,
    .test_missing_label_returns_400."""
    r = post(proto, "/update_weight_label", json={"weight_label": "step-0"})
    assert r.status_code == 200 and r.json() == {"weight_gen": 0, "weight_label": "step-0"}
    assert info(proto) == {"weight_gen": 0, "weight_label": "step-0"}
    for label in ("first", "second"):
        post(proto, "/update_weight_label", json={"weight_label": label})
    assert info(proto) == {"weight_gen": 0, "weight_label": "second"}
    assert post(proto, "/update_weight_label", json={}).status_code in (400, 422)
    assert get(proto, "/health").status_code == 200


def test_vllm_weight_gen_auto_increment(proto):
    """TestWeightGenAutoIncrement.test_gen_starts_at_zero_and_label_does_not_bump,
    .test_gen_is_monotonic_contract; and the increment on finish that their docstring defers to a real
    trainer, done here with the disk path."""
    for i in range(3):
        post(proto, "/update_weight_label", json={"weight_label": f"label-{i}"})
    assert info(proto) == {"weight_gen": 0, "weight_label": "label-2"}
    seen = [info(proto)["weight_gen"]]
    init(proto)
    for version in (1, 2, 3):
        proto.push(version, weights_for(proto.engine, seed=version))
        seen.append(info(proto)["weight_gen"])
    assert seen == [0, 1, 2, 3], seen


def test_vllm_weight_info_and_generate_coexist(proto):
    """TestWeightInfoWithGeneration.test_weight_info_and_generate_coexist."""
    before = info(proto)
    assert generates(proto)
    assert info(proto) == before


# tests/entrypoints/serve/dev/rlhf/test_state_machine.py and test_weight_update.py (vLLM)
def test_vllm_weight_update_ordering_without_init(proto):
    """test_state_machine.py TestWeightUpdateOrdering.test_start_without_init_returns_error,
    .test_finish_without_start_returns_error, .test_weight_update_endpoints_do_not_crash_engine;
    TestInitialState.test_weight_update_active_false_on_startup; test_weight_update.py
    TestWeightTransferProtocol.test_start_finish_no_tensors_engine_survives (start: 200 or 500, the one
    status 0.32's level fails, with 409)."""
    start = post(proto, "/start_weight_update", json={"is_checkpoint_format": True})
    assert start.status_code in (200, 500)
    message = start.json()["error"]["message"].lower()
    assert any(word in message for word in ("not configured", "weight transfer", "init")), message
    assert post(proto, "/finish_weight_update").status_code in (400, 409, 500)
    assert get(proto, "/health").status_code == 200
    assert generates(proto)
