"""Host digests spread over threads (harness.host_digest) must give every tensor its own digest, in order,
whatever the split: a digest landing on the wrong tensor would pass a corrupted one or refuse a good one."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import host_digest
from harness.manifest import digests, xxh3_digest


@settings(max_examples=200)
@given(st.lists(st.integers(0, 1 << 30), max_size=40), st.integers(1, 9))
def test_groups_hold_every_index_once_and_stay_balanced(sizes, n):
    groups = host_digest.groups(sizes, n)
    flat = sorted(k for g in groups for k in g)
    assert flat == list(range(len(sizes))), f"groups {groups} of sizes {sizes}"
    assert len(groups) <= n and all(groups)
    if groups:  # largest-first onto the least loaded: no group exceeds the fair share by more than one tensor
        loads = [sum(sizes[k] for k in g) for g in groups]
        assert max(loads) <= sum(sizes) / len(groups) + max(sizes), (loads, sizes)


def test_many_tensors_get_their_own_digests_in_order(monkeypatch):
    monkeypatch.setattr(host_digest, "_workers", lambda: 3)
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        for n in (5 << 20, 3, 7 << 20, 1 << 20, 0)
    ]
    seen: set[str] = set()
    real = xxh3_digest

    def recording(t):
        seen.add(threading.current_thread().name)
        return real(t)

    got = host_digest.map_hash(tensors, recording)
    assert got == [real(t) for t in tensors]
    assert any(name.startswith("weightsync-xxh3") for name in seen), f"hashed on {seen}: nothing in parallel"
    assert digests(tensors) == got  # the manifest's entry point takes the same route


def test_a_workers_error_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(host_digest, "_workers", lambda: 2)
    tensors = [torch.zeros(8 << 20, dtype=torch.uint8), torch.ones(8 << 20, dtype=torch.uint8)]

    def fails_on_ones(t):
        if int(t[0]) == 1:
            raise RuntimeError("disk on fire")
        return "ok"

    with pytest.raises(RuntimeError, match="disk on fire"):
        host_digest.map_hash(tensors, fails_on_ones)
