"""Invariant: the engine computes what the pushed checkpoint computes.

Weights read back by checkpoint name say what an engine stores, not what its forward pass uses: a head
derived from the embedding at load time, a prefix cache or a kept request's KV from the old version are
invisible to them. Here the engine's greedy tokens are scored against an independent forward — the
same checkpoint run by transformers, built from the engine's `model_config()` — token by token.
"""

from __future__ import annotations

import pytest

from fixtures.payloads import random_like_spec
from harness.api import GenerationRequest
from harness.deployment import push
from harness.independent_forward import score_kept, summary
from suites.conformance.helpers import (
    assert_computes_like,
    independent_forward,
    kept_in_flight,
    requests_in_flight,
    rerun_hint,
)

pytestmark = pytest.mark.single_receiver

PROMPTS = [tuple(range(7 + 5 * i, 7 + 5 * i + 9 + 4 * i)) for i in range(3)]  # 9, 13 and 17 tokens


def _generate(engine, tag, n=16):
    return engine.generate([GenerationRequest(f"{tag}-{i}", p, n) for i, p in enumerate(PROMPTS)])


def test_served_tokens_equal_an_independent_forward_of_the_pushed_checkpoint(weightsync_deployment, request):
    new = random_like_spec(weightsync_deployment.handles[0].engine.weight_spec(), seed=11)
    push(weightsync_deployment, 1, new)
    fwd = independent_forward(weightsync_deployment.handles[0].engine, new)
    for i, h in enumerate(weightsync_deployment.handles):
        for prompt, c in zip(PROMPTS, _generate(h.engine, f"v1-e{i}")):
            assert_computes_like(fwd, c, prompt, f"engine {i} at version 1", rerun_hint(request))


def _assert_streams_compute_like(fwd, streams, context: str, request) -> None:
    """Each stream's completion, once it ends, is what the independent forward `fwd` computes for its prompt."""
    for s in streams:
        assert_computes_like(
            fwd, s.result(timeout=60), s.request.prompt_token_ids, context, rerun_hint(request)
        )


def test_tied_head_computes_with_the_pushed_embedding(weightsync_tied_deployment, request):
    """A tied model has no lm_head in its checkpoint: the head is the embedding. Pushed whole, then the
    embedding alone: both times the served logits must follow the embedding pushed."""
    engine = weightsync_tied_deployment.handles[0].engine
    spec = engine.weight_spec()
    v1 = random_like_spec(spec, seed=21)
    push(weightsync_tied_deployment, 1, v1)
    for prompt, c in zip(PROMPTS, _generate(engine, "tied-v1")):
        assert_computes_like(
            independent_forward(engine, v1), c, prompt, "tied model, version 1", rerun_hint(request)
        )
    embed = {"model.embed_tokens.weight": random_like_spec(spec, seed=22)["model.embed_tokens.weight"]}
    push(weightsync_tied_deployment, 2, embed)
    fwd = independent_forward(engine, {**v1, **embed})
    for prompt, c in zip(PROMPTS, _generate(engine, "tied-v2")):
        assert_computes_like(
            fwd, c, prompt, "tied model, version 2 (only the embedding pushed)", rerun_hint(request)
        )


@pytest.mark.requires("pause_modes")
def test_kept_requests_continue_as_an_independent_forward_through_the_same_pause(
    weightsync_deployment, request
):
    """pause(keep), a commit, resume: tokens before the pause come from the old checkpoint; after it,
    from the new one, attending to the KV the old one computed or recomputing it (both allowed; the
    boundary is where the caller saw the pause land, not the engine's own version stamps)."""
    engine = weightsync_deployment.handles[0].engine
    old = independent_forward(engine, engine.read_weights())
    streams, frozen, _ = kept_in_flight(engine)
    new_weights = random_like_spec(engine.weight_spec(), seed=31)
    push(weightsync_deployment, 1, new_weights)
    engine.resume()
    new = independent_forward(engine, new_weights)
    for s, at_pause in zip(streams, frozen):
        c = s.result(timeout=120)
        found, reading = score_kept(old, new, s.request.prompt_token_ids, c.token_ids, at_pause)
        hint = f"\nthe continuation matches instead: {reading}" if reading else ""
        assert not found, (
            f"{c.request_id}: {at_pause} tokens at pause(keep), {len(c.token_ids)} in all; {len(found)} differ from "
            f"the old checkpoint up to the pause and the new one after it (over the kept KV; a recompute "
            f"does not match either):\n{summary(found)}{hint}\nrerun: {rerun_hint(request)}"
        )


@pytest.mark.requires("pause_modes")
def test_waited_and_queued_requests_compute_with_the_version_they_ran_on(weightsync_deployment, request):
    """pause(wait): requests in flight finish on the old checkpoint; those sent while paused run after
    resume on the new one; each scored against its version's independent forward."""
    engine = weightsync_deployment.handles[0].engine
    old = independent_forward(engine, engine.read_weights())
    streams = requests_in_flight(engine, tokens=1)
    engine.pause("wait")
    queued = [engine.submit(GenerationRequest(f"queued-{i}", p, 16)) for i, p in enumerate(PROMPTS)]
    new_weights = random_like_spec(engine.weight_spec(), seed=41)
    push(weightsync_deployment, 1, new_weights)
    engine.resume()
    new = independent_forward(engine, new_weights)
    _assert_streams_compute_like(old, streams, "finished under pause(wait), version 0", request)
    _assert_streams_compute_like(new, queued, "sent while paused, run on version 1", request)
