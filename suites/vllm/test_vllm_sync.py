"""Weight sync into real vLLM: exact delivery, correct outputs, whole fused and tied groups, and
refusals that leave the served weights untouched.

Every test runs on each form (in-process LLM, dev-mode server) and each model (Llama; Qwen2 with
tied embeddings). Weights go through the harness's DiskSender and VllmReceiver, i.e. vLLM's own
four-phase lifecycle with the harness transport inside vLLM; the oracle reads back what vLLM's
kernels compute with.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from harness.api import LifecycleError, ManifestMismatch, UnknownTensorError, VersionError
from harness.deployment import deliver, push
from harness.paths.disk import DiskSender

from .helpers import (
    assert_serves,
    assert_unchanged,
    engine_of,
    fresh_weights,
    greedy,
    next_version,
    push_new_version,
    rerun,
    snapshot,
    transformers_greedy,
)

pytestmark = pytest.mark.vllm


def test_update_is_bitwise_exact(vllm_deployment, request):
    version, weights = push_new_version(vllm_deployment)
    assert_serves(vllm_deployment, version, weights, "after a full update", rerun(request))


def test_greedy_tokens_equal_transformers_on_the_same_weights(vllm_deployment, request):
    version, weights = push_new_version(vllm_deployment)
    got = [c.token_ids for c in greedy(vllm_deployment)]
    expected = transformers_greedy(vllm_deployment, weights)
    assert got == expected, (
        f"{engine_of(vllm_deployment).describe()} at version {version}: greedy float32 tokens differ from "
        f"transformers on the same weights\n  vLLM:         {got}\n  transformers: {expected}\nrerun: {rerun(request)}"
    )


def test_served_tokens_are_stamped_with_the_committed_version(vllm_deployment, request):
    version, _ = push_new_version(vllm_deployment)
    for c in greedy(vllm_deployment):
        assert c.versions_seen == {version} and c.finish_reason == "length", (
            f"{c.request_id}: versions {sorted(c.versions_seen)}, finish {c.finish_reason!r}; expected "
            f"[{version}] and 'length'\nrerun: {rerun(request)}"
        )


def test_fused_groups_arrive_whole(vllm_deployment, request):
    """q/k/v (and their biases) and gate/up of one layer, nothing else: vLLM's fused qkv_proj and
    gate_up_proj must hold exactly the parts stacked in order, and every other tensor must stay."""
    engine = engine_of(vllm_deployment)
    _, before = snapshot(vllm_deployment)
    prefix = "model.layers.1."
    names = [n for n in engine.weight_spec() if n.startswith(prefix) and engine.layout.part(n) is not None]
    fused = {engine.layout.live_name(n) for n in names}
    assert {prefix + "self_attn.qkv_proj.weight", prefix + "mlp.gate_up_proj.weight"} <= fused, (
        f"expected q/k/v and gate/up of {prefix} to fuse, layout says {sorted(fused)}"
    )
    version, part = push_new_version(vllm_deployment, names)
    assert_serves(
        vllm_deployment, version, {**before, **part}, f"after pushing only {sorted(part)}", rerun(request)
    )
    live = engine.read_live()
    for live_name, expected in engine.layout.to_live(part).items():
        assert live[live_name].equal(expected), (
            f"{live_name}: the live fused tensor is not the parts {engine.layout.part(names[0]).group} stacked "
            f"in order\nrerun: {rerun(request)}"
        )


def test_tied_embedding_moves_the_lm_head(tied_deployment, request):
    """The checkpoint has no lm_head: pushing the embedding must move the output layer with it."""
    vllm_deployment = tied_deployment
    engine = engine_of(vllm_deployment)
    assert "lm_head.weight" not in engine.weight_spec(), (
        f"{engine.describe()}: a tied model lists lm_head.weight"
    )
    _, before = snapshot(vllm_deployment)
    version, part = push_new_version(vllm_deployment, ["model.embed_tokens.weight"])
    assert_serves(
        vllm_deployment, version, {**before, **part}, "after pushing the embedding only", rerun(request)
    )
    head = engine.read_live()["lm_head.weight"]
    assert head.equal(part["model.embed_tokens.weight"]), (
        f"{engine.describe()}: the tied LM head does not compute with the new embedding (max |diff| "
        f"{(head - part['model.embed_tokens.weight']).abs().max().item():.3g})\nrerun: {rerun(request)}"
    )
    got = [c.token_ids for c in greedy(vllm_deployment)]
    expected = transformers_greedy(vllm_deployment, {**before, **part})
    assert got == expected, (
        f"tied model after an embedding update:\n  vLLM: {got}\n  HF:   {expected}\nrerun: {rerun(request)}"
    )


# --------------------------------------------------------------------------------------------- refusals
def _refused(deployment, tensors, version, error, must_name, hint):
    """push() must raise `error` naming `must_name`, and the engine must keep version and weights."""
    before = snapshot(deployment)
    with pytest.raises(error) as info:
        push(deployment, version, tensors)
    assert must_name in str(info.value), f"the error does not name {must_name!r}: {info.value}\nrerun: {hint}"
    assert_unchanged(deployment, before, f"after a refused update ({type(info.value).__name__})", hint)
    return info.value


def test_unknown_tensor_is_refused_and_weights_kept(vllm_deployment, request):
    weights = fresh_weights(vllm_deployment)
    weights["model.layers.0.mlp.not_a_proj.weight"] = weights["model.norm.weight"].clone()
    _refused(
        vllm_deployment,
        weights,
        next_version(vllm_deployment),
        UnknownTensorError,
        "not_a_proj",
        rerun(request),
    )
    version, good = push_new_version(vllm_deployment)  # and the next sync succeeds
    assert_serves(vllm_deployment, version, good, "the update after a refused one", rerun(request))


def test_wrong_shape_is_refused_and_weights_kept(vllm_deployment, request):
    weights = fresh_weights(vllm_deployment)
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous()
    _refused(vllm_deployment, weights, next_version(vllm_deployment), ManifestMismatch, name, rerun(request))


def test_stale_version_is_refused_and_weights_kept(vllm_deployment, request):
    current = engine_of(vllm_deployment).weight_version
    _refused(
        vllm_deployment, fresh_weights(vllm_deployment), current, VersionError, str(current), rerun(request)
    )


def test_partial_fused_group_is_refused_and_weights_kept(vllm_deployment, request):
    name = "model.layers.0.self_attn.q_proj.weight"
    err = _refused(
        vllm_deployment, fresh_weights(vllm_deployment, [name]), next_version(vllm_deployment), ManifestMismatch, name,
        rerun(request),
    )  # fmt: skip
    assert "k_proj" in str(err) and "v_proj" in str(err), f"the error does not name the missing parts: {err}"


def test_restart_after_a_refused_part_commits_only_the_new_update(vllm_deployment, request):
    """A trainer that retries a refused update by starting again (no abort in between) gets a clean
    update: nothing of the refused one survives, and the retry lands whole."""
    dep, hint = vllm_deployment, rerun(request)
    receivers = [h.receiver for h in dep.handles]
    version = next_version(dep)
    bad = fresh_weights(dep)
    bad["model.norm.weight"] = bad["model.norm.weight"][:-1].clone()
    before = snapshot(dep)
    for r in receivers:
        r.start_weight_update()
    with pytest.raises(ManifestMismatch):
        deliver(dep, version, bad)
    dep.sender.complete(False)
    assert_unchanged(dep, before, "after a refused part", hint)
    good = fresh_weights(dep)
    for r in receivers:
        r.start_weight_update()  # restarts the failed update
    deliver(dep, version, good)
    for r in receivers:
        r.finish_weight_update(version)
    dep.sender.complete(True)
    assert_serves(dep, version, good, "the restarted update", hint)


@pytest.mark.parametrize(
    "bad",
    ["unknown name", "wrong shape", "partial fused group", "corrupted shard"],
)
def test_vllm_transport_refuses_bad_input_itself(vllm_deployment, bad, tmp_path, request):
    """Straight to vLLM's lifecycle (no harness receiver in front): the transport inside vLLM must
    refuse, say why, keep the served weights, and leave vLLM ready for the next update."""
    engine = engine_of(vllm_deployment)
    before = snapshot(vllm_deployment)
    sender = DiskSender(tmp_path / "raw")
    engine.init_weight_transfer_engine(sender.init())
    weights = fresh_weights(vllm_deployment)
    if bad == "unknown name":
        weights["lm_head.bias.not_here"] = weights["model.norm.weight"].clone()
        expected, named = UnknownTensorError, "lm_head.bias.not_here"
    elif bad == "wrong shape":
        weights["model.norm.weight"] = weights["model.norm.weight"][:-3].clone()
        expected, named = ManifestMismatch, "model.norm.weight"
    elif bad == "partial fused group":
        weights.pop("model.layers.1.mlp.up_proj.weight")
        expected, named = ManifestMismatch, "model.layers.1.mlp.up_proj.weight"
    else:
        expected, named = ManifestMismatch, "digest"
    version = next_version(vllm_deployment)
    info = sender.prepare(version, weights)
    if bad == "corrupted shard":
        shard = min(p for p in (tmp_path / "raw").rglob("*.safetensors"))
        raw = bytearray(shard.read_bytes())
        raw[-5] ^= 0xFF  # a flipped bit in the last tensor's payload: only the digest can tell
        shard.write_bytes(bytes(raw))
    engine.start_weight_update()
    with pytest.raises(expected) as err:
        engine.update_weights(info)
    assert named in str(err.value), (
        f"vLLM's error does not name {named!r}: {err.value}\nrerun: {rerun(request)}"
    )
    assert_unchanged(vllm_deployment, before, f"after vLLM refused an update ({bad})", rerun(request))
    with pytest.raises(LifecycleError):  # vLLM closed the refused update: nothing left to finish
        engine.finish_weight_update(str(version))
    assert engine.weight_version == before[0], (
        f"a refused update moved the version to {engine.weight_version}"
    )
    version, good = push_new_version(vllm_deployment)
    assert_serves(
        vllm_deployment, version, good, f"the update after vLLM refused one ({bad})", rerun(request)
    )
