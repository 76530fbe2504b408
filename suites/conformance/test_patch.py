"""Invariant 2: base(v) + patch(v -> v+1) == v+1 bit for bit; a patch is only ever applied to its base."""

from __future__ import annotations

import concurrent.futures as cf
import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fixtures.payloads import tensor_from_bits, weight_sets
from harness.api import BaseMismatch, TensorSpec, VersionError, spec_of
from harness.deployment import push
from harness.trainer import ReferenceTrainer
from suites.conformance.helpers import (
    assert_engines_hold,
    assert_unchanged,
    deliver_tampered,
    push_trainer_steps,
    rerun_hint,
    snapshot,
)

pytestmark = pytest.mark.requires("delta", "arbitrary_tensors")  # a bf16 policy beside the model

# A bf16 policy riding beside the engine's model: the regime delta is for (most entries unchanged).
POLICY_SPEC = {
    f"policy.{i}.weight": TensorSpec(shape, torch.bfloat16)
    for i, shape in enumerate([(256, 64), (64, 64), (129, 31), (1000,)])
}


def _policy_trainer(deployment, seed):
    deployment.reset(POLICY_SPEC)
    return ReferenceTrainer(POLICY_SPEC, seed=seed)


def _mutate(t: torch.Tensor, fraction: float, data) -> torch.Tensor:
    """A copy of t with about `fraction` of its elements replaced by arbitrary bits."""
    out = t.contiguous().clone()
    n = out.numel()
    k = round(fraction * n)
    if not k:
        return out
    idx = torch.tensor(
        data.draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True), label="idx")
    )
    width = out.element_size()
    bits = tensor_from_bits(
        data.draw(st.binary(min_size=k * width, max_size=k * width), label="bits"), (k,), out.dtype
    )
    out.reshape(-1)[idx] = bits
    return out


@pytest.mark.not_quick  # 1.3 s
@given(data=st.data(), fraction=st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.9, 1.0]) | st.floats(0, 1))
def test_patch_on_base_reproduces_the_next_version(
    weightsync_deployment,
    weightsync_backend,
    weightsync_capabilities,
    data,
    fraction,
    request,
    weightsync_example_counter,
):
    weightsync_example_counter()
    base = data.draw(weight_sets(dtypes=weightsync_capabilities.dtypes), label="base")
    nxt = {n: _mutate(t, fraction, data) for n, t in base.items()}
    weightsync_deployment.reset(spec_of(base))
    push(weightsync_deployment, 1, base)
    push(weightsync_deployment, 2, nxt)
    assert_engines_hold(
        weightsync_deployment,
        2,
        nxt,
        f"{weightsync_backend.name}: base + patch at {fraction:.0%} changed",
        rerun_hint(request),
    )


def test_patch_against_the_wrong_base_version_is_refused(weightsync_deployment, weightsync_backend):
    trainer = _policy_trainer(weightsync_deployment, 11)
    push(weightsync_deployment, *trainer.step())
    before = snapshot(weightsync_deployment)

    def claim_other_base(info):
        info["delta"]["base_version"] = 0
        return info

    with pytest.raises(BaseMismatch, match="patch made against version 0"):
        deliver_tampered(weightsync_deployment, *trainer.step(), claim_other_base)
    assert_unchanged(weightsync_deployment, before, "after a patch for another base version")


def test_patch_against_a_different_base_tensor_is_refused(weightsync_deployment, weightsync_backend):
    trainer = _policy_trainer(weightsync_deployment, 12)
    push(weightsync_deployment, *trainer.step())
    before = snapshot(weightsync_deployment)

    def claim_other_digest(info):
        name = next(n for n, e in info["delta"]["entries"].items() if e["mode"] == "sparse")
        info["delta"]["entries"][name]["base_digest"] = "0" * 32
        return info

    with pytest.raises(BaseMismatch, match="is not the patch's base"):
        deliver_tampered(weightsync_deployment, *trainer.step(), claim_other_digest)
    assert_unchanged(weightsync_deployment, before, "after a patch for another base tensor")


def _replay(deployment, update_info, payload, relabel=None):
    """Deliver the very same patch bytes again (optionally claiming a new version)."""
    sender = deployment.sender
    info = copy.deepcopy(update_info)
    if relabel is not None:
        info["manifest"]["version"] = relabel
    info["payload"] = sender.transport.prepare(info["manifest"]["version"], payload)
    for h in deployment.handles:
        h.receiver.start_weight_update()
    try:
        with cf.ThreadPoolExecutor(len(deployment.handles) + 1) as pool:
            futures = [pool.submit(sender.transport.transmit)]
            futures += [pool.submit(h.receiver.update_weights, info) for h in deployment.handles]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
    finally:
        for h in deployment.handles:
            h.receiver.abort_weight_update()
        sender.transport.complete(False)


def test_a_patch_applied_twice_is_refused(weightsync_deployment, weightsync_backend):
    trainer = _policy_trainer(weightsync_deployment, 13)
    push(weightsync_deployment, *trainer.step())
    version, weights = trainer.step()
    captured_info = weightsync_deployment.sender.prepare(
        version, weights
    )  # capture the exact patch v1 -> v2 ...
    payload = weightsync_deployment.sender.last_payload
    weightsync_deployment.sender.complete(False)
    push(weightsync_deployment, version, weights)  # ... then apply it for real
    before = snapshot(weightsync_deployment)
    with pytest.raises(VersionError, match="not newer"):
        _replay(weightsync_deployment, captured_info, payload)
    with pytest.raises(BaseMismatch):
        _replay(weightsync_deployment, captured_info, payload, relabel=version + 1)
    assert_unchanged(weightsync_deployment, before, "after replaying a patch")


@pytest.mark.single_receiver
def test_fifty_trainer_steps_by_delta_equal_full_syncs(weightsync_deployment, weightsync_backend, request):
    """Each version the trainer makes, sent as a patch, lands exactly as a full sync would put it."""
    trainer = _policy_trainer(weightsync_deployment, 14)
    push_trainer_steps(
        weightsync_deployment, trainer, 52, f"{weightsync_backend.name} trainer step", rerun_hint(request)
    )
    history = weightsync_deployment.sender.history[-51:]
    sparse = sum(s.sparse_tensors for s in history)
    assert sparse == len(POLICY_SPEC) * len(history), (
        f"{sparse} of {len(POLICY_SPEC) * len(history)} tensor updates went as patches; at the trainer's "
        f"sparsity every one should (moved/dense per step: {[round(s.ratio, 4) for s in history[:5]]}...)"
    )


# ------------------------------------------------------------------------------------------ special values
# v -> v+1 differing only where a comparison of values sees nothing (-0.0 == +0.0), or sees a change
# everywhere (NaN != NaN), or in the smallest step a float has (one subnormal): a patch must carry bits.
SPECIAL_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_INT_OF = {2: torch.int16, 4: torch.int32}
ZEROS, NANS, SUBNORMALS = (3, 100, 2000), (5, 700), (9,)


def _special_base(dtype: torch.dtype, n: int = 4096) -> torch.Tensor:
    gen = torch.Generator().manual_seed(21)
    t = torch.randn(n, generator=gen).to(dtype)
    bits = t.view(_INT_OF[t.element_size()])
    width = 8 * t.element_size()
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    exponent_all_ones = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    bits[list(ZEROS)] = 0  # +0.0
    bits[list(NANS)] = exponent_all_ones | (1 << (mantissa - 1)) | 0b10  # a quiet NaN with a payload
    bits[list(SUBNORMALS)] = 1  # the smallest positive subnormal
    return t


def _special_change(base: torch.Tensor, kind: str) -> torch.Tensor:
    out = base.clone()
    bits = out.view(_INT_OF[out.element_size()])
    sign = -(1 << (8 * out.element_size() - 1))  # the sign bit, as the signed integer type holds it
    if kind == "signed-zero":
        bits[list(ZEROS)] = sign  # -0.0: equal to +0.0 as a value
    elif kind == "nan-payload":
        bits[list(NANS)] ^= 0b1  # still a NaN, another payload
    elif kind == "subnormal":
        bits[list(SUBNORMALS)] += 1  # the next subnormal up
    return out


@pytest.mark.single_receiver  # what a patch carries does not depend on how many receive it
@pytest.mark.parametrize("kind", ["signed-zero", "nan-payload", "subnormal"])
@pytest.mark.parametrize("dtype_name", list(SPECIAL_DTYPES))
def test_a_patch_carries_special_values_bit_for_bit(
    weightsync_deployment, weightsync_backend, weightsync_capabilities, kind, dtype_name, request
):
    dtype = SPECIAL_DTYPES[dtype_name]
    if dtype not in weightsync_capabilities.dtypes:
        pytest.skip(f"NOT_SUPPORTED: {weightsync_backend.name} does not claim {dtype}")
    base = {"special.weight": _special_base(dtype), "other.weight": _special_base(dtype)[:1000].clone()}
    nxt = {**base, "special.weight": _special_change(base["special.weight"], kind)}
    weightsync_deployment.reset(spec_of(base))
    push(weightsync_deployment, 1, base)  # dense: the first push after a reset
    push(weightsync_deployment, 2, nxt)  # the patch: only the special values differ
    history = getattr(weightsync_deployment.sender, "history", None)
    if history:  # the built-in delta says how it moved the version: it must have been a patch
        assert history[-1].sparse_tensors >= 1, (
            f"{weightsync_backend.name}: v1 -> v2 went dense: {history[-1]}"
        )
    assert_engines_hold(
        weightsync_deployment,
        2,
        nxt,
        f"{weightsync_backend.name}: a patch changing only {kind} ({dtype_name})",
        rerun_hint(request),
    )
    push(weightsync_deployment, 3, base)  # and back again
    assert_engines_hold(
        weightsync_deployment,
        3,
        base,
        f"{weightsync_backend.name}: the patch undoing {kind} ({dtype_name})",
        rerun_hint(request),
    )
