"""The four-phase lifecycle over HTTP: bit-exact delivery, out-of-order refusals, and retries that never
apply an update twice (lost answers, requests that never arrived, idempotency keys, vLLM-style labels)."""

from __future__ import annotations

import httpx
import pytest

from harness.api import EngineStateError, GenerationRequest, LifecycleError, UnknownTensorError, VersionError
from harness.checks import assert_bitwise_equal
from harness.control.app import ServerThread
from harness.control.client import AmbiguousResultError, ControlClient
from harness.control.remote import RemoteDeployment
from harness.control.server import ControlServer, ServerConfig
from harness.deployment import push
from harness.engines.reference import ReferenceEngine
from harness.paths.broadcast import BroadcastReceiver, BroadcastSender
from harness.paths.disk import DiskSender
from suites.control.helpers import LoseAnswers, request, weights_for


@pytest.fixture
def commits(served, monkeypatch) -> list[int]:
    """Versions the engine committed, in order (counts every commit_weights the receiver makes)."""
    calls: list[int] = []
    original = served.engine.commit_weights

    def counting(tensors, version):
        calls.append(version)
        return original(tensors, version)

    monkeypatch.setattr(served.engine, "commit_weights", counting)
    return calls


def deployment_with(served, client: ControlClient, name: str) -> RemoteDeployment:
    """A second trainer-side deployment onto the same server, through `client`."""
    return RemoteDeployment(DiskSender(served.root / name), [client], [served.engine.read_weights])


def attempts(client: ControlClient, path: str) -> list[str]:
    return [outcome for p, outcome in client.attempts if p == path]


# --------------------------------------------------------------------------------------------- delivery
def test_push_over_http_lands_bit_for_bit_and_serves_the_new_version(served):
    for version in (1, 2):
        w = weights_for(served.engine, seed=version)
        served.push(version, w)
        assert_bitwise_equal(w, served.engine.read_weights(), f"after pushing version {version} over HTTP")
        info = served.client.weight_status()
        assert info["weight_version"] == str(version), f"weight_info {info}"
        assert info.get("engine_version", version) == version, f"weight_status {info}"  # vLLM has none
    if served.foreign is not None:  # its model is its own: what it computes is judged by the vLLM tier
        return
    fresh = ReferenceEngine()
    try:
        fresh.commit_weights(weights_for(fresh, seed=2), 2)
        req = request(12, "fresh")
        expected = fresh.generate([req])[0]
    finally:
        fresh.shutdown()
    got = served.client.complete(GenerationRequest("remote-" + req.request_id, req.prompt_token_ids, 12))
    assert got.token_ids == expected.token_ids, (
        f"served {got.token_ids}, a fresh engine with v2 gives {expected.token_ids}"
    )
    assert got.versions_seen == {2}, f"tokens stamped {got.versions_seen}, expected {{2}}"


def test_broadcast_data_plane_behind_the_server(tmp_path):
    engine = ReferenceEngine()
    token = "broadcast-token-0123456789"
    cfg = ServerConfig(token=token, allowed_dirs=(tmp_path,), init_overrides={"rank": 1})
    thread = ServerThread(ControlServer(engine, BroadcastReceiver(engine), cfg)).start()
    client = ControlClient(thread.url, token=token)
    deployment = RemoteDeployment(
        BroadcastSender(1, "gloo", bucket_bytes=1 << 16, timeout_s=30), [client], [engine.read_weights]
    )
    try:
        w = weights_for(engine, seed=5)
        push(deployment, 1, w)
        assert_bitwise_equal(w, engine.read_weights(), "broadcast bytes, HTTP control")
        assert client.weight_status()["engine_version"] == 1
    finally:
        deployment.close()
        thread.stop()
        engine.shutdown()


# --------------------------------------------------------------------------------------------- retries
def test_lost_answer_to_update_weights_is_replayed_not_reapplied(served, commits):
    client = served.new_client(transport=LoseAnswers("/update_weights"))
    w = weights_for(served.engine, seed=1)
    push(deployment_with(served, client, "ck-upd"), 1, w)
    assert attempts(client, "/update_weights") == ["unknown: ReadTimeout", "200"], client.attempts
    assert commits == [1], f"commits {commits}: the retried update_weights must not stage twice"
    assert served.client.stats()["idempotent_replays"] == 1
    assert_bitwise_equal(w, served.engine.read_weights(), "after a replayed update_weights")


def test_lost_answer_to_finish_is_replayed_not_reapplied(served, commits):
    client = served.new_client(transport=LoseAnswers("/finish_weight_update"))
    push(deployment_with(served, client, "ck-fin"), 1, weights_for(served.engine, seed=1))
    assert attempts(client, "/finish_weight_update") == ["unknown: ReadTimeout", "200"], client.attempts
    assert commits == [1], f"commits {commits}"


def test_lost_finish_without_idempotency_keys_is_recognised_by_version(served, commits):
    """What the client does against vLLM, which de-duplicates nothing: read /weight_info."""
    client = served.new_client(idempotency_keys=False, transport=LoseAnswers("/finish_weight_update"))
    push(deployment_with(served, client, "ck-vllm"), 1, weights_for(served.engine, seed=1))
    assert attempts(client, "/finish_weight_update") == [
        "unknown: ReadTimeout",
        "recognised: already committed",
    ], client.attempts
    assert commits == [1], f"commits {commits}"


def test_unknown_outcome_of_update_without_keys_is_reported_not_retried(served, commits):
    client = served.new_client(idempotency_keys=False, transport=LoseAnswers("/update_weights"))
    with pytest.raises(AmbiguousResultError, match="may or may not have applied"):
        push(deployment_with(served, client, "ck-amb"), 1, weights_for(served.engine, seed=1))
    assert attempts(client, "/update_weights") == ["unknown: ReadTimeout"], client.attempts
    assert commits == [] and served.engine.weight_version == 0, f"commits {commits}"
    w = weights_for(served.engine, seed=2)
    served.client.init_weight_transfer_engine(served.deployment.init_info)  # back to the fixture's sender
    served.push(1, w)  # the discarded update does not block the next one
    assert commits == [1]
    assert_bitwise_equal(w, served.engine.read_weights(), "next push after an ambiguous update")


def test_request_that_never_reached_the_server_is_retried(served, commits):
    client = served.new_client(
        idempotency_keys=False, transport=LoseAnswers("/start_weight_update", mode="request")
    )
    push(deployment_with(served, client, "ck-conn"), 1, weights_for(served.engine, seed=1))
    assert attempts(client, "/start_weight_update") == ["not sent: ConnectError", "200"], client.attempts
    assert commits == [1]


def test_finish_of_a_committed_version_is_recognised_not_reapplied(served, commits):
    served.push(1, weights_for(served.engine, seed=1))
    again = served.client.finish_weight_update(1)
    raw = httpx.post(
        f"{served.url}/finish_weight_update", json={"weight_version": "1"}, headers=served.auth()
    )
    assert again["already_committed"] is True, again
    assert raw.status_code == 200 and raw.json()["already_committed"] is True, raw.text
    assert commits == [1], f"commits {commits}"
    assert served.client.stats()["finish_recognised"] == 2


def test_finish_of_the_committed_version_with_a_newer_one_staged_is_refused(served, commits):
    """Not a retry: a 200 here would tell the client a commit landed while version 2 stays staged."""
    served.push(1, weights_for(served.engine, seed=1))
    staged = weights_for(served.engine, seed=2)
    served.client.start_weight_update()
    served.client.update_weights(served.deployment.sender.prepare(2, staged))
    raw = httpx.post(
        f"{served.url}/finish_weight_update", json={"weight_version": "1"}, headers=served.auth()
    )
    assert raw.status_code == 409 and raw.json()["error"]["type"] == "VersionError", raw.text
    assert "version 2 is staged" in raw.json()["error"]["message"], raw.text
    assert served.client.weight_status()["update_in_progress"] is True
    assert served.client.stats()["finish_recognised"] == 0
    served.client.finish_weight_update(2)
    assert commits == [1, 2], f"commits {commits}"
    assert_bitwise_equal(staged, served.engine.read_weights(), "version 2 after the refused finish(1)")


def test_idempotency_key_reused_for_another_request_is_refused(served):
    url, key = f"{served.url}/update_weight_version", "key-0123456789"
    headers = {**served.auth(), "Idempotency-Key": key}
    first = httpx.post(url, json={"new_version": "policy-a"}, headers=headers)
    replay = httpx.post(url, json={"new_version": "policy-a"}, headers=headers)
    other = httpx.post(url, json={"new_version": "policy-b"}, headers=headers)
    assert (first.status_code, replay.status_code, other.status_code) == (200, 200, 422), (
        first.text,
        replay.text,
        other.text,
    )
    assert other.json()["error"]["type"] == "IdempotencyKeyReused", other.text
    assert served.client.weight_version() == "policy-a"


# --------------------------------------------------------------------------------------------- refusals
def test_out_of_order_calls_are_refused_and_the_server_recovers(served):
    c = served.client
    info = served.deployment.sender.prepare(1, weights_for(served.engine, seed=1))
    with pytest.raises(LifecycleError, match="outside an update") as e1:
        c.update_weights(info)
    with pytest.raises(LifecycleError) as e2:
        c.finish_weight_update(1)
    c.start_weight_update()
    with pytest.raises(LifecycleError, match="in progress") as e3:
        c.start_weight_update()
    assert {e.value.status for e in (e1, e2, e3)} == {409}, [str(e.value) for e in (e1, e2, e3)]
    c.update_weights(info)
    c.finish_weight_update(1)
    assert served.engine.weight_version == 1
    c.start_weight_update()
    with pytest.raises(VersionError, match="not newer"):
        c.update_weights(info)  # version 1 again, now that 1 is committed
    c.abort_weight_update()
    assert served.engine.weight_version == 1 and not c.weight_status()["update_in_progress"]


def test_refused_update_weights_poisons_the_finish(served, commits):
    c = served.client
    c.start_weight_update()
    info = served.deployment.sender.prepare(1, weights_for(served.engine, seed=1))
    forged = {
        **info,
        "manifest": {**info["manifest"], "entries": [dict(e) for e in info["manifest"]["entries"]]},
    }
    forged["manifest"]["entries"][0]["name"] = "model.layers.99.mystery.weight"
    with pytest.raises(UnknownTensorError, match="mystery") as refused:
        c.update_weights(forged)
    assert refused.value.status == 422
    with pytest.raises(LifecycleError, match="refused update_weights"):
        c.finish_weight_update(1)
    assert commits == [] and served.engine.weight_version == 0
    served.push(1, weights_for(served.engine, seed=1))
    assert commits == [1]


def test_older_version_is_refused(served):
    served.push(2, weights_for(served.engine, seed=2))
    with pytest.raises(VersionError, match="already committed") as e:
        served.client.finish_weight_update(1)
    assert e.value.status == 409 and served.engine.weight_version == 2


def test_version_labels_follow_vllm(served):
    """vLLM labels versions with free strings at finish, or later with /update_weight_version."""
    c = served.client
    c.start_weight_update()
    c.update_weights(served.deployment.sender.prepare(1, weights_for(served.engine, seed=1)))
    c.finish_weight_update("step-1")
    info = c.weight_status()
    # the committed number beside the label: this server's /weight_status (vLLM has only /weight_info's label)
    assert (info["weight_version"], info.get("engine_version", 1)) == ("step-1", 1), info
    c.update_weight_version("policy-7")
    assert c.weight_info()["weight_version"] == "policy-7" and served.engine.weight_version == 1
    c.start_weight_update()
    c.update_weights(served.deployment.sender.prepare(2, weights_for(served.engine, seed=2)))
    c.finish_weight_update(None)  # what vLLM's HTTPVLLMWeightSyncClient sends: no body at all
    info = c.weight_status()
    assert (info["weight_version"], info.get("engine_version", 2)) == ("2", 2), info


# --------------------------------------------------------------------------------------------- a refused commit
def test_a_refused_finish_leaves_weight_info_on_the_old_version_and_label(served):
    """A finish the server refuses (it names a version other than the staged one) commits nothing, so
    /weight_info must still report the old version's label: a server that publishes the new label before
    the commit, and keeps it when the commit fails, tells rollouts they run on weights they do not have.
    HTTP only: runs against any server under test."""
    c = served.client
    c.start_weight_update()
    c.update_weights(served.deployment.sender.prepare(1, weights_for(served.engine, seed=1)))
    c.finish_weight_update("step-1")
    assert c.weight_version() == "step-1", c.weight_info()
    c.start_weight_update()
    c.update_weights(served.deployment.sender.prepare(2, weights_for(served.engine, seed=2)))
    # by hand: ControlClient would read /weight_info to resolve the refusal, and a server that publishes
    # early makes it report a commit that never ran
    refused = httpx.post(
        served.url + "/finish_weight_update", json={"weight_version": "3"}, headers=served.auth(), timeout=60
    )  # version 2 is staged: nothing may commit
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "VersionError", refused.text
    assert c.weight_info() == {"weight_version": "step-1"}, (
        f"/weight_info after a refused finish of version 3 (2 staged, 1 committed as 'step-1'): "
        f"{c.weight_info()}; the refused version's label was published although nothing committed"
    )
    assert served.engine.weight_version == 1, served.client.weight_status()


def test_a_commit_that_fails_in_the_engine_leaves_weight_info_on_the_old_label(served, monkeypatch):
    """The engine itself fails the commit (injected into the reference server's engine): the finish is
    an error and /weight_info keeps the committed version's label."""
    served.push(1, weights_for(served.engine, seed=1))

    def fails(tensors, version):
        raise EngineStateError(f"injected: the engine failed to commit version {version}")

    monkeypatch.setattr(served.engine, "commit_weights", fails)
    c = served.client
    c.start_weight_update()
    c.update_weights(served.deployment.sender.prepare(2, weights_for(served.engine, seed=2)))
    with pytest.raises(EngineStateError, match="injected"):
        c.finish_weight_update("step-2")
    assert c.weight_info() == {"weight_version": "1"}, (
        f"/weight_info after the engine failed to commit version 2 (labelled 'step-2'): {c.weight_info()}"
    )
    assert served.engine.weight_version == 1
