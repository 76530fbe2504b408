"""Invariant 4: after finish, output equals a fresh engine loaded with the new weights.

The prompt is served once before the update so that whatever the engine caches (prefix KV) holds
results of the old weights; an engine that keeps serving them after the commit fails here.
"""

from __future__ import annotations

import pytest

from fixtures.payloads import random_like_spec
from harness.api import GenerationRequest
from harness.deployment import push

pytestmark = pytest.mark.single_receiver

PROMPT = tuple(range(7, 7 + 24))  # several prefix-cache blocks long


def _greedy(engine, rid, n=12):
    (c,) = engine.generate([GenerationRequest(rid, PROMPT, n)])
    return c


def test_generation_after_update_equals_a_fresh_engine(deployment):
    engine = deployment.handles[0].engine
    spec = engine.weight_spec()
    _greedy(engine, "warm-1")
    _greedy(engine, "warm-2")  # now the prompt's prefix is cached under version 0
    new = random_like_spec(spec, seed=42)
    push(deployment, 1, new)
    served = [_greedy(h.engine, f"after-{i}") for i, h in enumerate(deployment.handles)]

    # The same weights into fresh engines, nothing cached. The deployment's own engines are replaced
    # rather than a second engine started beside them (two in-process vLLMs cannot share a process).
    deployment.reset(None)
    push(deployment, 1, new)
    want = _greedy(deployment.handles[0].engine, "fresh")
    for i, got in enumerate(served):
        assert got.token_ids == want.token_ids, (
            f"engine {i} after update: {got.token_ids}\nfresh engine with the same weights: {want.token_ids}\n"
            "stale cached state from version 0 was served (prefix cache not invalidated?)"
        )
        assert got.versions_seen == {1}, f"engine {i}: tokens from versions {sorted(got.versions_seen)}"


def test_old_and_new_versions_produce_different_output(deployment):
    """Guards the test above: if both versions gave the same tokens it could not catch anything."""
    engine = deployment.handles[0].engine
    before = _greedy(engine, "v0")
    push(deployment, 1, random_like_spec(engine.weight_spec(), seed=42))
    after = _greedy(engine, "v1")
    assert before.token_ids != after.token_ids, "version 0 and 1 produce identical tokens; pick another seed"
