"""Invariant 4: after finish, output equals a fresh engine loaded with the new weights.

The prompt is served once before the update so that whatever the engine caches (prefix KV) holds
results of the old weights; an engine that keeps serving them after the commit fails here. Under
traffic (requests in flight across the update, paused with wait or keep) new requests are scored against
an independent forward of the new checkpoint: a kept request's KV was computed with the old weights, and
an engine that caches it as prefix blocks after the commit serves it to the next request.
"""

from __future__ import annotations

import pytest

from fixtures.payloads import random_like_spec
from harness.api import GenerationRequest
from harness.deployment import push
from suites.conformance.helpers import (
    PREFIX_BLOCKS,
    assert_computes_like,
    independent_forward,
    kept_in_flight,
    requests_in_flight,
    rerun_hint,
)

pytestmark = pytest.mark.single_receiver

PROMPT = tuple(range(7, 7 + 24))  # several prefix-cache blocks long


def _greedy(engine, rid, n=12):
    (c,) = engine.generate([GenerationRequest(rid, PROMPT, n)])
    return c


def test_generation_after_update_equals_a_fresh_engine(weightsync_deployment):
    engine = weightsync_deployment.handles[0].engine
    spec = engine.weight_spec()
    _greedy(engine, "warm-1")
    _greedy(engine, "warm-2")  # now the prompt's prefix is cached under version 0
    new = random_like_spec(spec, seed=42)
    push(weightsync_deployment, 1, new)
    served = [_greedy(h.engine, f"after-{i}") for i, h in enumerate(weightsync_deployment.handles)]

    # The same weights into fresh engines, nothing cached. The deployment's own engines are replaced
    # rather than a second engine started beside them (two in-process vLLMs cannot share a process).
    weightsync_deployment.reset(None)
    push(weightsync_deployment, 1, new)
    want = _greedy(weightsync_deployment.handles[0].engine, "fresh")
    for i, got in enumerate(served):
        assert got.token_ids == want.token_ids, (
            f"engine {i} after update: {got.token_ids}\nfresh engine with the same weights: {want.token_ids}\n"
            "stale cached state from version 0 was served (prefix cache not invalidated?)"
        )
        assert got.versions_seen == {1}, f"engine {i}: tokens from versions {sorted(got.versions_seen)}"


def test_old_and_new_versions_produce_different_output(weightsync_deployment):
    """Guards the test above: if both versions gave the same tokens it could not catch anything."""
    engine = weightsync_deployment.handles[0].engine
    before = _greedy(engine, "v0")
    push(weightsync_deployment, 1, random_like_spec(engine.weight_spec(), seed=42))
    after = _greedy(engine, "v1")
    assert before.token_ids != after.token_ids, "version 0 and 1 produce identical tokens; pick another seed"


@pytest.mark.not_quick  # 2.7 s
@pytest.mark.requires("pause_modes")
@pytest.mark.parametrize("mode", ["wait", "keep"])
def test_new_requests_after_an_update_under_traffic_compute_with_the_new_weights(
    weightsync_deployment, mode, request
):
    engine = weightsync_deployment.handles[0].engine
    _greedy(engine, "warm")  # the prompt's prefix cached under version 0
    if mode == "keep":
        streams, frozen, _ = kept_in_flight(engine, prompt=PROMPT)
    else:
        streams = requests_in_flight(engine, tokens=1, prompt=PROMPT)
        engine.pause("wait")
        frozen = [s.token_count for s in streams]
    new = random_like_spec(engine.weight_spec(), seed=42)
    push(weightsync_deployment, 1, new)
    engine.resume()
    first = streams[0].result(timeout=120)
    for s in streams[1:]:
        s.result(timeout=120)
    # Prompts whose prefixes were computed under version 0: the warmed prompt, a part of it, and the
    # first in-flight request's own sequence up to where the pause caught it (its KV is version 0's).
    sequence = [*PROMPT, *first.token_ids]
    old_positions = len(PROMPT) + frozen[0] - 1
    cuts = sorted({old_positions // block * block for block in PREFIX_BLOCKS if old_positions >= block})
    prompts = [PROMPT, PROMPT[: 2 * PREFIX_BLOCKS[0] + 1], *(tuple(sequence[: n + 1]) for n in cuts)]
    fwd = independent_forward(engine, new)
    for i, prompt in enumerate(prompts):
        (c,) = engine.generate([GenerationRequest(f"after-{mode}-{i}", prompt, 12)])
        assert_computes_like(
            fwd,
            c,
            prompt,
            f"new request after an update under pause({mode}) traffic (stale KV from version 0 served?)",
            rerun_hint(request),
        )
