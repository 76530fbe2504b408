"""vLLM 0.32's RL HTTP API, route by route, against this harness's server: the same bodies, the same
answers, vLLM's error object (400 with `param` for a request that fails validation), and 409 for a
lifecycle step out of order, decided before the body is read. suites/control/README.md has the table."""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
import torch

from harness.checks import assert_bitwise_equal
from harness.paths.disk import DiskSender
from suites.control.helpers import request, require_route, weights_for

VLLM_ERROR_KEYS = {"message", "type", "param", "code"}
CHECKSUM_PREFIX = "dp0:pp0:pcp0:tp0:"  # vLLM's key prefix for a single-rank worker


def post(served, path: str, **kwargs) -> httpx.Response:
    require_route(served, "POST", path)
    return httpx.post(served.url + path, headers=served.auth(), timeout=30, **kwargs)


def get(served, path: str, **kwargs) -> httpx.Response:
    require_route(served, "GET", path)
    return httpx.get(served.url + path, timeout=30, **kwargs)


def assert_error(
    resp: httpx.Response, status: int, type_: str, param: str | None, fragment: str = ""
) -> None:
    """The answer is vLLM's ErrorResponse: {"error": {message, type, param, code}} with these values."""
    shown = f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text[:400]}"
    assert resp.status_code == status, shown
    err = resp.json().get("error")
    assert isinstance(err, dict) and set(err) == VLLM_ERROR_KEYS, f"not vLLM's error object: {shown}"
    assert (err["type"], err["param"], err["code"]) == (type_, param, status), shown
    assert fragment.lower() in err["message"].lower(), f"message does not say {fragment!r}: {shown}"


def stage(served, version: int, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """init + start over HTTP and a checkpoint on disk: the update_info that delivers it, and its tensors."""
    sender = DiskSender(served.root / f"stage-{version}-{seed}")
    assert post(served, "/init_weight_transfer_engine", json={"init_info": sender.init()}).status_code == 200
    assert post(served, "/start_weight_update").status_code == 200
    tensors = weights_for(served.engine, seed=seed)
    return sender.prepare(version, tensors), tensors


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("path", "query", "body", "param", "fragment"),
    [
        ("/update_weight_version", None, {"new_version": 7}, "body.new_version", "string"),
        ("/update_weight_version", None, {}, "body.new_version", "required"),
        ("/init_weight_transfer_engine", None, {}, "body.init_info", "required"),
        ("/pause", {"mode": "sleep"}, None, "query.mode", "mode"),
        ("/pause", {"mode": "keep", "clear_cache": "maybe"}, None, "query.clear_cache", "boolean"),
        ("/update_weight_version", None, b'{"new_version": ', "body", "json"),
    ],
    ids=lambda v: str(v)[:24],
)
def test_validation_errors_are_400_with_vllm_error_object_naming_the_param(
    served, path, query, body, param, fragment
):
    kwargs = {"content": body, "headers": {**served.auth(), "content-type": "application/json"}}
    if not isinstance(body, bytes):
        kwargs = {"json": body} if body is not None else {}
    resp = (
        httpx.post(served.url + path, params=query, timeout=30, **kwargs)
        if "headers" in kwargs
        else post(served, path, params=query, **kwargs)
    )
    assert_error(resp, 400, "Bad Request", param, fragment)


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/update_weights", b'{"update_info": "not an object"}'),
        ("/update_weights", b"{not json"),
        ("/finish_weight_update", b'{"weight_version": [1]}'),
        ("/finish_weight_update", b""),
    ],
    ids=repr,
)
def test_lifecycle_order_is_409_before_the_body_is_read(served, path, raw):
    sender = DiskSender(served.root / "ck")
    assert post(served, "/init_weight_transfer_engine", json={"init_info": sender.init()}).status_code == 200
    headers = {**served.auth(), "content-type": "application/json"}
    before_start = httpx.post(served.url + path, content=raw, headers=headers, timeout=30)
    assert_error(before_start, 409, "LifecycleError", None, "start_weight_update")
    assert post(served, "/start_weight_update").status_code == 200
    after_start = httpx.post(served.url + path, content=raw, headers=headers, timeout=30)
    assert after_start.status_code in (400, 409), after_start.text[:300]
    if raw.strip() and after_start.status_code == 400:
        assert after_start.json()["error"]["param"].startswith("body"), after_start.text[:300]


def test_a_malformed_update_inside_an_update_is_400_naming_update_info(served):
    stage(served, 1, seed=1)
    assert_error(
        post(served, "/update_weights", json={"update_info": "x"}), 400, "Bad Request", "body.update_info"
    )


# --------------------------------------------------------------------------------------------- weight_info
def test_weight_info_is_exactly_vllms_answer_and_default_when_fresh(served):
    assert get(served, "/weight_info").json() == {"weight_version": "default"}
    status = get(served, "/weight_status").json()
    assert (status["weight_version"], status["engine_version"], status["update_in_progress"]) == (
        "default",
        0,
        False,
    ), status
    served.push(1, weights_for(served.engine, seed=1))
    assert get(served, "/weight_info").json() == {"weight_version": "1"}
    assert get(served, "/weight_status").json()["engine_version"] == 1


@pytest.mark.parametrize("label", ["checkpoint/final", "runs/exp-3/step-12", "default"])
def test_version_labels_with_a_slash_are_taken_as_vllm_takes_them(served, label):
    resp = post(served, "/update_weight_version", json={"new_version": label})
    assert resp.json() == {"success": True, "new_version": label}, resp.text[:300]
    assert get(served, "/weight_info").json() == {"weight_version": label}
    info, tensors = stage(served, 1, seed=1)
    assert post(served, "/update_weights", json={"update_info": info}).status_code == 200
    finish = post(served, "/finish_weight_update", json={"weight_version": f"{label}/next"})
    assert finish.status_code == 200, finish.text[:300]
    assert get(served, "/weight_info").json() == {"weight_version": f"{label}/next"}
    assert_bitwise_equal(tensors, served.engine.read_weights(), f"finish labelled {label}/next")


# --------------------------------------------------------------------------------------------- update_info list
def test_update_info_as_a_list_delivers_this_workers_element(make_served):
    served = make_served(worker_index=1)
    info, tensors = stage(served, 1, seed=3)
    short = post(served, "/update_weights", json={"update_info": [info]})
    assert_error(short, 400, "Bad Request", "body.update_info", "index 1")
    resp = post(served, "/update_weights", json={"update_info": [{"ignored": True}, info]})
    assert resp.json() == {"message": "Weights updated"}, resp.text[:300]
    assert post(served, "/finish_weight_update", json={"weight_version": "1"}).status_code == 200
    assert_bitwise_equal(tensors, served.engine.read_weights(), "update_info given as a list")


def test_update_info_list_of_non_objects_is_400(served):
    stage(served, 1, seed=1)
    assert_error(
        post(served, "/update_weights", json={"update_info": [1]}), 400, "Bad Request", "body.update_info"
    )


# --------------------------------------------------------------------------------------------- world size
def test_get_world_size_answers_like_vllm(served):
    assert get(served, "/get_world_size").json() == {"world_size": 1}
    assert get(served, "/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
    bad = get(served, "/get_world_size", params={"include_dp": "maybe"})
    assert_error(bad, 400, "Bad Request", "query.include_dp", "boolean")


# --------------------------------------------------------------------------------------------- sleep
def test_sleep_frees_the_weights_queues_requests_and_wake_restores_them_bit_for_bit(served):
    served.push(1, weights_for(served.engine, seed=1))
    before = served.engine.read_weights()
    assert get(served, "/is_sleeping").json() == {"is_sleeping": False}
    resp = post(served, "/sleep", params={"level": "1"})
    assert resp.json() == {"status": "sleeping", "level": 1}, resp.text[:300]
    assert get(served, "/is_sleeping").json() == {"is_sleeping": True}
    assert served.engine.resident_weight_bytes() == 0, "asleep at level 1 but the weights are resident"
    offloaded = list(served.server.workdir.glob("*.safetensors"))
    assert len(offloaded) == 1, f"expected one offloaded file in {served.server.workdir}: {offloaded}"
    stream = served.client.submit(
        request(4, "asleep")
    )  # accepted and queued, as vLLM's paused scheduler does
    assert not stream.wait_for_tokens(1, timeout=0.5), "a request ran while the engine was asleep"
    assert_error(post(served, "/resume"), 409, "EngineStateError", None, "asleep")
    assert_error(post(served, "/start_weight_update"), 409, "EngineStateError", None, "asleep")
    assert post(served, "/weight_checker", json={"action": "checksum"}).status_code == 409
    woke = post(served, "/wake_up")
    assert woke.json() == {"status": "awake", "tags": None}, woke.text[:300]
    assert get(served, "/is_sleeping").json() == {"is_sleeping": False}
    assert_bitwise_equal(before, served.engine.read_weights(), "after sleep(level=1) and wake_up")
    assert not list(served.server.workdir.glob("*.safetensors")), "the offloaded file outlived wake_up"
    assert stream.result(timeout=30).finish_reason == "length", "the queued request did not run after wake"
    served.push(2, weights_for(served.engine, seed=2))


def test_partial_wake_by_tags_stays_asleep_until_every_tag_is_up(served):
    before = served.engine.read_weights()
    post(served, "/sleep", params={"level": "1"})
    weights = post(served, "/wake_up", params={"tags": "weights"})
    assert weights.json() == {"status": "sleeping", "tags": ["weights"]}, weights.text[:300]
    assert served.engine.resident_weight_bytes() > 0, "wake_up(tags=weights) left the weights offloaded"
    assert get(served, "/is_sleeping").json() == {"is_sleeping": True}
    kv = post(served, "/wake_up", params={"tags": "kv_cache"})
    assert kv.json() == {"status": "awake", "tags": ["kv_cache"]}, kv.text[:300]
    assert_bitwise_equal(before, served.engine.read_weights(), "after a wake_up in two tags")
    assert_error(post(served, "/wake_up", params={"tags": "gpu"}), 400, "Bad Request", "query.tags", "gpu")


def test_sleep_level_0_pauses_only_and_level_2_discards_the_weights(served):
    assert post(served, "/sleep", params={"level": "0"}).json() == {"status": "sleeping", "level": 0}
    assert served.engine.resident_weight_bytes() > 0 and served.engine.is_paused
    assert post(served, "/wake_up").json() == {"status": "awake", "tags": None}
    assert not served.engine.is_paused
    assert post(served, "/sleep", params={"level": "2"}).json() == {"status": "sleeping", "level": 2}
    assert served.engine.resident_weight_bytes() == 0
    assert not list(served.server.workdir.glob("*.safetensors")), "level 2 keeps no copy of the weights"
    assert post(served, "/wake_up").json()["status"] == "awake"
    zeros = {n: torch.zeros_like(t) for n, t in served.engine.read_weights().items()}
    assert_bitwise_equal(zeros, served.engine.read_weights(), "level 2 wakes with undefined (zero) weights")
    served.push(1, weights_for(served.engine, seed=1))  # a trainer reloads after a level-2 sleep


@pytest.mark.parametrize(
    ("query", "param"), [({"level": "3"}, "query.level"), ({"mode": "nap"}, "query.mode")], ids=str
)
def test_sleep_refuses_bad_query_with_vllm_error(served, query, param):
    assert_error(post(served, "/sleep", params=query), 400, "Bad Request", param)
    assert get(served, "/is_sleeping").json() == {"is_sleeping": False}


# --------------------------------------------------------------------------------------------- weight checker
def test_weight_checker_checksum_compare_and_reset(served):
    resp = post(served, "/weight_checker", json={"action": "checksum"})
    checksums = resp.json()["checksums"]
    expected = {CHECKSUM_PREFIX + n: sha256_of(t) for n, t in served.engine.read_weights().items()}
    assert checksums == expected, f"{resp.text[:300]} != {list(expected.items())[:2]}"
    same = post(served, "/weight_checker", json={"action": "compare", "baseline": checksums})
    assert same.json() == {"match": True, "mismatches": []}, same.text[:300]
    served.push(1, weights_for(served.engine, seed=1))
    changed = post(served, "/weight_checker", json={"action": "compare", "baseline": checksums}).json()
    assert changed == {"match": False, "mismatches": sorted(checksums)}, changed
    assert post(served, "/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
    assert all(not t.any() for t in served.engine.read_weights().values()), "reset left non-zero weights"
    assert get(served, "/weight_info").json() == {"weight_version": "1"}, "reset changed the version"


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"action": "compare"}, None, "baseline"),
        ({"action": "bogus"}, "body.action", "checksum"),
        ({}, "body.action", "required"),
        ({"action": "compare", "baseline": {"a": 1}}, "body.baseline.a", "string"),
    ],
    ids=str,
)
def test_weight_checker_refusals(served, body, param, fragment):
    assert_error(post(served, "/weight_checker", json=body), 400, "Bad Request", param, fragment)


def test_weight_checker_answers_while_paused_as_vllm_does(served):
    assert post(served, "/pause", params={"mode": "keep"}).status_code == 200
    resp = post(served, "/weight_checker", json={"action": "checksum"})
    assert resp.status_code == 200 and len(resp.json()["checksums"]) == len(served.engine.weight_spec()), (
        resp.text[:300]
    )


def test_finish_has_no_checksum_option_in_vllm_0_32(served):
    info, _ = stage(served, 1, seed=1)
    assert post(served, "/update_weights", json={"update_info": info}).status_code == 200
    refused = post(served, "/finish_weight_update", json={"weight_version": "1", "checksum": True})
    assert_error(refused, 400, "Bad Request", "body.checksum", "extra")
    assert post(served, "/finish_weight_update", json={"weight_version": "1"}).status_code == 200


def _sse_lines(resp: httpx.Response) -> list[str]:
    return [line for line in resp.iter_lines() if line]


def test_a_stream_paused_mid_way_sends_only_data_lines_as_vllm_does(make_served):
    """vLLM sends nothing while a stream is frozen and its clients assert every line is `data: `; a
    keepalive comment (opt-in, ServerConfig.keepalive_s) broke vLLM's own pause test."""
    quiet, chatty = make_served(), make_served(keepalive_s=0.05)
    assert quiet.server.config.keepalive_s is None, "vLLM sends no keepalive; the default must not either"
    for served, comments in ((quiet, False), (chatty, True)):
        body = {"prompt": list(request(6).prompt_token_ids), "max_tokens": 6, "stream": True}
        served.client.pause("keep")
        with httpx.stream(
            "POST", served.url + "/v1/completions", json=body, headers=served.auth(), timeout=30
        ) as resp:
            assert resp.status_code == 200, resp.read()
            lines = resp.iter_lines()
            # the request is queued behind the pause; its stream is open and idle
            deadline = time.monotonic() + 10
            while not served.server.live_streams() and time.monotonic() < deadline:
                time.sleep(0.01)
            idle_until = time.monotonic() + 0.3  # six keepalive periods of the chatty server
            while time.monotonic() < idle_until:
                time.sleep(0.05)
            served.client.resume()
            seen = [line for line in lines if line]
        others = [line for line in seen if not line.startswith("data: ")]
        assert seen[-1] == "data: [DONE]", seen[-3:]
        if comments:
            assert others and set(others) == {": keepalive"}, f"keepalive_s=0.05 sent {others[:3]}"
        else:
            assert not others, f"default server sent non-data lines on a paused stream: {others[:3]}"


def test_load_counts_completions_in_flight(served):
    assert get(served, "/load").json() == {"server_load": 0}
    served.client.pause("keep")
    streams = [served.client.submit(request(3)) for _ in range(3)]
    assert get(served, "/load").json() == {"server_load": 3}
    served.client.resume()
    for s in streams:
        s.result(30)
    assert get(served, "/load").json() == {"server_load": 0}
