"""Engines on a device and the same-GPU zero-copy CUDA IPC path (needs CUDA: the GPU run, .ci/gpu-run.sh).

The reference engine built on a GPU keeps its weights, forward passes and caches there, and a commit of
device tensors adopts them (no host hop). Over CUDA IPC, a trainer whose tensors qualify shares its own
storages (IpcSender._in_place): the engine's copy is the only copy, digested in the same pass. These tests
show it delivers bit for bit, refuses a released or forged handle with the engine unchanged, and holds no
more mappings or device memory after many syncs than after one."""

from __future__ import annotations

import pytest
import torch

from harness.api import ManifestMismatch, TransferError, spec_of
from harness.backends.ipc import make_cuda_backend
from harness.bench import payload
from harness.checks import bitwise_mismatches
from harness.deployment import push
from harness.engines.reference import ReferenceEngine
from harness.engines.tiny_lm import ModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.meta,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = "cuda:0"


def _versions(weights, n, seed=1):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for _ in range(n):
        yield {k: torch.randn(t.shape, generator=gen, device=DEVICE).to(t.dtype) for k, t in weights.items()}


def test_the_reference_engine_lives_on_its_device_and_adopts_device_tensors():
    engine = ReferenceEngine(ModelConfig(dtype=torch.bfloat16), device=DEVICE)
    try:
        spec = engine.weight_spec()
        name = "model.norm.weight"  # not fused: the live tensor is the one committed
        new = {n: torch.randn(s.shape, device=DEVICE).to(s.dtype) for n, s in spec.items()}
        engine.commit_weights(new, 1)
        live = engine._live[name]
        assert live.device.type == "cuda" and live.data_ptr() == new[name].data_ptr(), (
            f"{name}: live on {live.device}, same storage as committed: {live.data_ptr() == new[name].data_ptr()}"
        )
        assert all(t.device.type == "cuda" for t in engine._live.values())
        from harness.api import GenerationRequest

        stream = engine.submit(GenerationRequest("r", (1, 2, 3, 4, 5, 6, 7, 8, 9), max_tokens=4))
        c = stream.result(timeout=60)
        assert c.finish_reason == "length" and len(c.token_ids) == 4, (c.finish_reason, c.token_ids)
        assert all(k.device.type == "cuda" for cache in engine._prefix_cache.values() for k, _ in cache)
        assert not bitwise_mismatches(new, engine.read_weights())
    finally:
        engine.shutdown()


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    monkeypatch.setenv("WEIGHTSYNC_DEVICE", DEVICE)  # ranks build their engines on the GPU
    weights = payload(64 << 20, 8, device=DEVICE)
    dep = make_cuda_backend().deploy(1, spec_of(weights), str(tmp_path))
    try:
        yield dep, weights
    finally:
        dep.close()


def test_in_place_sync_is_bitwise_and_shares_the_trainers_storages(deployment):
    dep, weights = deployment
    for v, w in enumerate(_versions(weights, 3), start=1):
        info = dep.sender.prepare(v, w)
        assert "in_place" in info and not info["buffers"], "device tensors that qualify went packed"
        dep.sender.complete(False)
        push(dep, v, w)
        assert dep.handles[0].engine.weight_version == v
        wrong = bitwise_mismatches(w, dep.handles[0].engine.read_weights())
        assert not wrong, f"version {v}: {wrong[:3]}"


@pytest.mark.parametrize("forgery", ["released", "token", "placement"])
def test_a_released_or_forged_in_place_handle_is_refused_and_nothing_changes(deployment, forgery):
    dep, weights = deployment
    push(dep, 1, weights)
    before = dep.handles[0].engine.read_weights()
    new = next(_versions(weights, 1, seed=9))
    info = dep.sender.prepare(2, new)
    if forgery == "released":
        dep.sender.complete(False)
    elif forgery == "token":
        info["token"] = "ab" * 16
    else:
        placed = info["in_place"]["tensors"]  # the first two tensors read from each other's storage
        placed[0][0], placed[1][0] = placed[1][0], placed[0][0]
    r = dep.handles[0].receiver
    r.start_weight_update()
    with pytest.raises((TransferError, ManifestMismatch)) as caught:
        r.update_weights(info)
    r.abort_weight_update()
    dep.sender.complete(False)
    expected = {"released": "stale", "token": "foreign", "placement": "digest"}[forgery]
    assert expected in str(caught.value), str(caught.value)
    assert dep.handles[0].engine.weight_version == 1
    assert not bitwise_mismatches(before, dep.handles[0].engine.read_weights())


def test_many_in_place_syncs_hold_no_more_device_memory_than_one(deployment):
    """Nothing the trainer allocates grows with the number of syncs: after the first sync of each of the
    two versions (what is kept per layout is kept by then, once), 30 more hold no more device memory."""
    dep, weights = deployment
    versions = list(_versions(weights, 2))
    held = []
    for v in range(1, 33):
        push(dep, v, versions[v % 2])
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated(DEVICE))
    warm = held[1]  # both versions synced once
    assert held[-1] <= warm, (
        f"trainer holds {held[-1]} bytes after 32 syncs, {warm} after the first of each version "
        f"(after each sync: {held})"
    )
    assert not bitwise_mismatches(versions[32 % 2], dep.handles[0].engine.read_weights())


def test_weights_updated_in_place_are_shared_once_and_delivered_bit_for_bit(deployment):
    """A trainer's optimizer updates its weights in place: the next sync names the same storages, and the
    sender hands out the handles it made for them before (no new IPC event or ref-count slot per sync, none
    opened again in the receiver) while every sync still delivers the bytes as they are now."""
    dep, weights = deployment
    push(dep, 1, weights)
    first = [h for _, h in dep.sender._handles.values()]
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    for v in range(2, 6):
        for t in weights.values():  # an optimizer step
            t.add_(torch.randn(t.shape, generator=gen, device=DEVICE).to(t.dtype))
        push(dep, v, weights)
        wrong = bitwise_mismatches(weights, dep.handles[0].engine.read_weights())
        assert not wrong, f"version {v}, updated in place: {wrong[:3]}"
        again = [h for _, h in dep.sender._handles.values()]
        assert len(again) == len(first) and all(a is b for a, b in zip(again, first)), (
            f"version {v}: {sum(a is not b for a, b in zip(again, first))} of {len(first)} storages shared anew"
        )
