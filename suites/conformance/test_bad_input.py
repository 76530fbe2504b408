"""Bad input gets a specific error naming tensor and version, and loses nothing: every engine keeps
serving its last committed version bit for bit, and the next good sync succeeds."""

from __future__ import annotations

import pytest
import torch

from fixtures.payloads import random_like_spec
from harness.api import BackendError, LifecycleError, ManifestMismatch, UnknownTensorError, VersionError
from harness.deployment import push
from harness.faults.cell import next_step
from harness.registry import resolve_backend
from suites.conformance.helpers import assert_unchanged, deliver_tampered, push_and_check, snapshot

pytestmark = pytest.mark.single_receiver


@pytest.fixture
def at_version_1(weightsync_deployment):
    """The deployment after one good push (so 'unchanged' means version 1, not the initial weights)."""
    spec = weightsync_deployment.handles[0].engine.weight_spec()
    push(weightsync_deployment, 1, random_like_spec(spec, seed=1))
    return weightsync_deployment


def _model_weights(deployment, seed):
    return random_like_spec(deployment.handles[0].engine.weight_spec(), seed=seed)


def _then_recovers(deployment, context):
    """The next good sync is the trainer's next step from version 1 (as a trainer recovers), so a patch
    path sends a patch against what the engines held through the refusal."""
    step = next_step(_model_weights(deployment, seed=1), seed=2)
    push_and_check(deployment, 2, step, f"{context}: next good sync")


def _refused(deployment, exc_type, tensors, version, must_name):
    before = snapshot(deployment)
    with pytest.raises(exc_type) as info:
        push(deployment, version, tensors)
    message = str(info.value)
    for fragment in must_name:
        assert fragment in message, f"error {message!r} does not name {fragment!r}"
    assert_unchanged(deployment, before, f"after refused {exc_type.__name__}")
    return message


def test_unknown_tensor_name_is_refused(at_version_1, weightsync_backend):
    weights = {**_model_weights(at_version_1, 3), "model.layers.99.mystery.weight": torch.zeros(4)}
    _refused(at_version_1, UnknownTensorError, weights, 2, ["model.layers.99.mystery.weight", "version 2"])
    _then_recovers(at_version_1, "unknown tensor")


def test_wrong_dtype_is_refused(at_version_1):
    weights = _model_weights(at_version_1, 3)
    name = next(iter(weights))
    weights[name] = weights[name].to(torch.float16 if weights[name].dtype != torch.float16 else torch.float32)
    _refused(at_version_1, ManifestMismatch, weights, 2, [name, "version 2"])
    _then_recovers(at_version_1, "wrong dtype")


def test_wrong_shape_is_refused(at_version_1):
    weights = _model_weights(at_version_1, 3)
    name = next(iter(weights))
    weights[name] = torch.zeros(
        weights[name].shape[0] + 1, *weights[name].shape[1:], dtype=weights[name].dtype
    )
    _refused(at_version_1, ManifestMismatch, weights, 2, [name, "version 2"])
    _then_recovers(at_version_1, "wrong shape")


@pytest.mark.parametrize("version", [1, 0, -5], ids=["same", "older", "negative"])
def test_version_not_newer_is_refused(at_version_1, version):
    _refused(at_version_1, VersionError, _model_weights(at_version_1, 4), version, [f"version {version}"])
    _then_recovers(at_version_1, "stale version")


def test_corrupted_digest_is_refused(at_version_1):
    """The bytes arrive intact but the manifest says otherwise: the receiver must not commit."""
    weights = _model_weights(at_version_1, 5)

    def forge(info):
        info["manifest"]["entries"][0]["digest"] = "0" * 32
        return info

    before = snapshot(at_version_1)
    # disk sees the forged manifest differ from the committed one; streaming paths see the digest differ
    with pytest.raises(ManifestMismatch, match="version 2"):
        deliver_tampered(at_version_1, 2, weights, forge)
    assert_unchanged(at_version_1, before, "after forged digest")
    _then_recovers(at_version_1, "forged digest")


@pytest.mark.parametrize(
    "update_info",
    [{}, {"manifest": "garbage"}, {"manifest": {"version": "2"}}],
    ids=["no-manifest", "not-a-dict", "string-version"],
)
def test_malformed_update_info_is_refused(at_version_1, update_info):
    """Refused before the data plane is touched, so no transmit is needed."""
    before = snapshot(at_version_1)
    for h in at_version_1.handles:
        h.receiver.start_weight_update()
        with pytest.raises(ManifestMismatch):
            h.receiver.update_weights(update_info)
        h.receiver.abort_weight_update()
    assert_unchanged(at_version_1, before, "after malformed update_info")
    _then_recovers(at_version_1, "malformed update_info")


def test_finish_with_another_version_is_refused(at_version_1):
    from harness.deployment import deliver

    before = snapshot(at_version_1)
    for h in at_version_1.handles:
        h.receiver.start_weight_update()
    deliver(at_version_1, 2, _model_weights(at_version_1, 6))
    for h in at_version_1.handles:
        with pytest.raises(VersionError, match=r"finish_weight_update\(3\).*version 2"):
            h.receiver.finish_weight_update(3)
    assert_unchanged(at_version_1, before, "after finish with the wrong version")
    for h in at_version_1.handles:  # the refused finish left the update open; drop it
        h.receiver.abort_weight_update()
    _then_recovers(at_version_1, "wrong finish version")


def test_partial_fused_group_is_refused(at_version_1):
    """q_proj without k_proj and v_proj would leave the fused qkv half-updated."""
    spec = at_version_1.handles[0].engine.weight_spec()
    q = next((n for n in spec if n.endswith("q_proj.weight")), None)
    if q is None:
        pytest.skip("NOT_SUPPORTED: the engine has no fused q/k/v group")
    _refused(at_version_1, ManifestMismatch, random_like_spec({q: spec[q]}, 7), 2, [q, "version 2"])
    _then_recovers(at_version_1, "partial fused group")


@pytest.mark.parametrize(
    "call",
    ["update-before-start", "finish-before-start", "start-twice", "finish-with-nothing"],
)
def test_out_of_order_calls_are_refused(at_version_1, call):
    before = snapshot(at_version_1)
    for h in at_version_1.handles:
        r = h.receiver
        with pytest.raises(LifecycleError):
            if call == "update-before-start":
                r.update_weights({"manifest": {}})
            elif call == "finish-before-start":
                r.finish_weight_update(2)
            elif call == "start-twice":
                r.start_weight_update()
                try:
                    r.start_weight_update()
                finally:
                    r.abort_weight_update()
            else:
                r.start_weight_update()
                try:
                    r.finish_weight_update(2)
                finally:
                    r.abort_weight_update()
    assert_unchanged(at_version_1, before, f"after {call}")
    _then_recovers(at_version_1, call)


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("no-such-backend", "unknown backend 'no-such-backend'"),
        ("no.such.module:factory", "cannot import module 'no.such.module'"),
        ("harness.registry:no_such_factory", "has no attribute 'no_such_factory'"),
        ("harness.registry:BUILTIN_BACKENDS", "not a callable factory"),
    ],
)
def test_bad_backend_selection_is_explained(name, fragment):
    with pytest.raises(BackendError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        resolve_backend(name)
