"""The vLLM control target (`suites.vllm.control_target:start`) recycles its server: closing a test's server
puts it back to a fresh server's state over its own routes, and the next test is served by it. It must be
as fresh as a new one: label "default", the checkpoint's weights bit for bit, not paused, nothing in flight
(the requests a test left have ended),
no update open, no transport root of the last test accepted; and a server that cannot be put back is not
handed on.

    python -m pytest suites/vllm/test_vllm_control_target.py -m vllm
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from harness.checks import assert_bitwise_equal
from harness.control.client import ControlClient
from harness.engines.tiny_hf_models import load_checkpoint
from harness.paths.disk import DiskSender
from suites.control.helpers import start_streams, wait_tokens

pytestmark = pytest.mark.vllm


def _post(url: str, route: str, **kwargs) -> httpx.Response:
    resp = httpx.post(url + route, timeout=120, **kwargs)
    assert resp.status_code == 200, f"POST {route}: {resp.status_code} {resp.text[:300]}"
    return resp


def test_a_server_closed_in_any_state_is_handed_on_fresh(tmp_path):
    from suites.vllm import control_target

    first = control_target.start(tmp_path / "first")
    try:
        base = load_checkpoint(first.model_dir)
        url = first.url
        client = ControlClient(url)
        old_root = DiskSender(first.data_dir / "old-root")
        pushed = {n: t + 0.25 for n, t in base.items()}
        _post(url, "/init_weight_transfer_engine", json={"init_info": old_root.init()})
        _post(url, "/start_weight_update")
        _post(url, "/update_weights", json={"update_info": old_root.prepare(1, pushed)})
        _post(url, "/finish_weight_update", json={"weight_version": "policy-7"})
        streams = start_streams(client, 2, 2000, "left-in-flight")
        wait_tokens(streams, 1)
        _post(url, "/pause", params={"mode": "keep"})  # paused with requests held
        _post(url, "/start_weight_update")  # an update left open
    finally:
        first.close()

    second = control_target.start(tmp_path / "second")
    try:
        assert second is first and second.url == url, (
            "start made a new server: the restore of the last failed"
        )
        assert second.data_dir == tmp_path / "second" / "data", (
            "the recycled server kept the last test's folder"
        )
        info = httpx.get(url + "/weight_info", timeout=30).json()
        paused = httpx.get(url + "/is_paused", timeout=30).json()["is_paused"]
        assert (info.get("weight_version"), paused) == ("default", False), (info, paused)
        left = [s.request.request_id for s in streams if not s.done]
        load = httpx.get(url + "/load", timeout=30).json()
        assert not left and load == {"server_load": 0}, f"handed on with requests in flight: {left}, {load}"
        assert_bitwise_equal(base, second.read_weights(), "the recycled server's weights")
        start = httpx.post(url + "/start_weight_update", timeout=60)
        assert start.status_code == 500 and "before init_weight_transfer_engine" in start.text, (
            f"a recycled server still had a transport (or an open update): {start.status_code} {start.text[:300]}"
        )
        _post(url, "/init_weight_transfer_engine", json={"init_info": DiskSender(tmp_path / "new").init()})
        _post(url, "/start_weight_update")
        stale = httpx.post(
            url + "/update_weights", json={"update_info": old_root.prepare(2, base)}, timeout=60
        )
        assert stale.status_code >= 400 and "outside the roots" in stale.text, (
            f"the last test's transport root was accepted: {stale.status_code} {stale.text[:300]}"
        )
    finally:
        second.close()  # handed on again: the next test's first server (a start less, ~20 s on 2 cores)


def test_a_server_that_cannot_be_put_back_is_not_handed_on(tmp_path):
    from suites.vllm import control_target

    first = control_target.start(tmp_path / "first")  # the last test's server where it left one
    assert first.process.alive, "start handed on a server that is not running"
    url = first.url
    first.process.stop()  # a server that died in its test
    first.close()
    assert control_target._spare is None, "a dead server was kept for the next test"
    second = control_target.start(tmp_path / "second")
    try:
        assert second is not first and second.url != url
        assert httpx.get(second.url + "/weight_info", timeout=30).json() == {"weight_version": "default"}
    finally:
        second.close()
        control_target.release_spare()
