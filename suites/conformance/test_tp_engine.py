"""The tensor-parallel reference engine (issue 39 item 2): M rank processes, each holding only its vLLM
shard of every parameter, whose forward needs all M (harness/engines/tp_reference.py).

What it must do: compute what the single-process model computes on the same full weights (greedy tokens
equal, logits within float32 rounding); hold exactly the oracle's shard on every rank and gather them back
bit for bit; commit a version on every rank or on none; stamp each token with the version every rank
computed it with; keep requests in flight through pause(abort | wait | keep) and a commit; fail, naming
the rank, within its timeout when a rank dies or hangs. The rank implementation under test is
harness.engines.tp_rank:TPRank unless WEIGHTSYNC_TP_RANK names another (`pkg.module:Class`; the meta
tests' broken ranks).

    pytest suites/conformance/test_tp_engine.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.reshard_shapes import DTYPES, model_shapes
from harness.api import (
    EngineStateError,
    GenerationRequest,
    ManifestMismatch,
    PartialCommitError,
    VersionError,
)
from harness.checks import assert_bitwise_equal
from harness.engines import tiny_lm, tp_model
from harness.engines.tp_reference import RANK_IMPL, TP_MODEL, TPReferenceEngine
from harness.procs import pid_alive
from harness.reshard.gather import gather_full
from harness.reshard.layout import ModelShape, engine_layout, full_weights
from harness.reshard.oracle import expected_engine_shards

RANK_ENV = "WEIGHTSYNC_TP_RANK"
RANK = os.environ.get(RANK_ENV, RANK_IMPL)
RERUN = "pytest suites/conformance/test_tp_engine.py" + (
    f" (with {RANK_ENV}={RANK})" if RANK != RANK_IMPL else ""
)
THOROUGH = settings.get_current_profile_name() == "weightsync-thorough"
#: TP 3: heads 6, one kv head on all three ranks, a tied head, vocab 100 padded to 144 (rank 2: 4 real rows)
TP3_MODEL = ModelShape(
    vocab=100,
    hidden=24,
    heads=6,
    kv_heads=1,
    head_dim=4,
    intermediate=30,
    layers=2,
    tied=True,
    vocab_padding=48,
)
SHAPES = {1: TP_MODEL, 2: TP_MODEL, 3: TP3_MODEL}
PROMPTS = [(1, 2, 3, 4, 5), (42,), (7, 99, 7, 99, 7, 99, 7, 0), (10, 20, 30)]
#: Bound on every wait for a stream (seconds): a step takes milliseconds
WAIT_S = 60
#: |logprob| difference allowed against the single-process model: the all-reduce adds partial sums in
#: another order (float32 rounding, ~1e-6 on these logits)
LOGPROB_TOL = 1e-4


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def engines():
    """One engine per TP size, started on first use and shut down after the module; then no rank lives."""
    made: dict[int, TPReferenceEngine] = {}

    def get(m: int) -> TPReferenceEngine:
        if m not in made:
            made[m] = TPReferenceEngine(SHAPES[m], tp=m, timeout_s=20, rank_impl=RANK)
        return made[m]

    yield get
    pids = [p for e in made.values() for p in e.rank_pids()]
    for e in made.values():
        e.shutdown()
    assert not [p for p in pids if pid_alive(p)], f"rank processes left after shutdown: {pids}"


# ------------------------------------------------------------------------------------------ helpers
def reference_tokens(
    shape: ModelShape, prompt, weights_per_token: list[dict]
) -> tuple[list[int], list[float]]:
    """Greedy tokens (and their logprobs) of the single-process model (tiny_lm), token i computed with
    weights_per_token[i] over the KV cache the earlier tokens' weights computed (what a kept request, or
    one a commit lands under, continues from)."""
    cfg = tp_model.tiny_lm_config(shape)
    tokens, logprobs, cache = [], [], None
    for i, weights in enumerate(weights_per_token):
        fed = list(prompt) if i == 0 else tokens[-1:]
        logits, cache = tiny_lm.forward(cfg, tiny_lm.fuse(weights), fed, cache)
        tokens.append(int(torch.argmax(logits)))
        logprobs.append(float(torch.log_softmax(logits, -1)[tokens[-1]]))
    return tokens, logprobs


def assert_computes_like(shape, stream, weights_by_version: dict[int, dict], what: str) -> None:
    """The stream's tokens equal the single-process model's, each token computed with the weights of the
    version it is stamped with; logprobs within LOGPROB_TOL."""
    events = [e for e in stream if e.token_id is not None]
    versions = [e.weight_version for e in events]
    want, want_lp = reference_tokens(
        shape, stream.request.prompt_token_ids, [weights_by_version[v] for v in versions]
    )
    got = [e.token_id for e in events]
    assert got == want, (
        f"{what}: request {stream.request.request_id} prompt {stream.request.prompt_token_ids}: TP engine "
        f"tokens {got} (versions {versions}), single-process model {want}\nrerun: {RERUN}"
    )
    worst = max((abs(e.logprob - w) for e, w in zip(events, want_lp)), default=0.0)
    assert worst <= LOGPROB_TOL, (
        f"{what}: logprob off the single-process model's by {worst:.3g}\nrerun: {RERUN}"
    )


def fresh_weights(engine: TPReferenceEngine, seed: int) -> dict[str, torch.Tensor]:
    return tp_model.init_weights(engine.shape, engine.dtype, seed)


def in_flight(engine, tag: str, max_tokens: int = 40, tokens: int = 2):
    """Requests running with `tokens` tokens out already (bounded wait)."""
    streams = [engine.submit(GenerationRequest(f"{tag}-{i}", p, max_tokens)) for i, p in enumerate(PROMPTS)]
    for s in streams:
        assert s.wait_for_tokens(tokens, WAIT_S), f"{s.request.request_id}: no {tokens} tokens in {WAIT_S}s"
    return streams


# ------------------------------------------------------------------------------------------ shards
@st.composite
def tp_cases(draw):
    m = draw(st.integers(1, 4), label="tp")
    return m, draw(model_shapes(m)), draw(DTYPES), draw(st.integers(0, 2**16))


@settings(max_examples=3000 if THOROUGH else 300, deadline=None)
@given(tp_cases())
def test_cut_then_gather_is_the_identity_bit_for_bit(case):
    """Over drawn shapes (kv heads fewer / equal / more than M, vocab padding that leaves ranks padding
    only, tied or not, qkv bias) and M 1..4: the oracle's cut of random bit patterns (NaN payloads, -0.0),
    gathered back, is the checkpoint bit for bit."""
    m, shape, dtype, seed = case
    full = full_weights(shape, dtype, seed)
    layout = engine_layout(shape, m)
    got = gather_full(layout, [expected_engine_shards(full, layout, r) for r in range(m)])
    want = {n: full[n] for n in shape.checkpoint_shapes()}
    assert sorted(got) == sorted(want), (
        f"TP {m} {shape}: gathered names {sorted(set(got) ^ set(want))} differ"
    )
    assert_bitwise_equal(want, got, f"TP {m}, {dtype}, {shape}", RERUN)


def test_gather_names_the_rank_whose_replicated_copy_differs():
    """A rank left with another version of a replicated tensor (a norm; the one kv head all ranks hold) is
    named, not hidden behind rank 0's copy."""
    layout = engine_layout(TP3_MODEL, 3)
    full = full_weights(TP3_MODEL, "float32", 1)
    for name in ("model.norm.weight", "model.layers.1.self_attn.qkv_proj.weight"):
        shards = [expected_engine_shards(full, layout, r) for r in range(3)]
        shards[2] = {**shards[2], name: shards[2][name].clone()}
        shards[2][name].view(-1).view(torch.uint8)[-1:].bitwise_xor_(1)  # in the last row: a norm, a v row
        with pytest.raises(ManifestMismatch, match="engine rank 2") as err:
            gather_full(layout, shards)
        assert name in str(err.value), f"the refusal names {err.value}, not {name}"


@pytest.mark.parametrize("m", [2, 3])
def test_every_rank_holds_exactly_its_oracle_shard(engines, m):
    engine = engines(m)
    full = engine.read_weights()
    if engine.shape.tied:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    for r, shards in enumerate(engine.read_shards()):
        want = {n: t for n, t in expected_engine_shards(full, engine.layout, r).items() if n in shards}
        assert sorted(shards) == sorted(want), f"rank {r} holds {sorted(shards)}"
        assert_bitwise_equal(want, shards, f"TP {m} rank {r}'s live shards against the oracle", RERUN)


# ------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("m", [1, 2, 3])
def test_greedy_tokens_equal_the_single_process_model(engines, m):
    """The same full weights through one process (tiny_lm) and through M ranks: every greedy token equal,
    logprobs within float32 rounding, every token stamped with the committed version."""
    engine = engines(m)
    weights = engine.read_weights()
    streams = [engine.submit(GenerationRequest(f"greedy-{i}", p, 12)) for i, p in enumerate(PROMPTS)]
    for s in streams:
        s.result(WAIT_S)
        assert_computes_like(engine.shape, s, {engine.weight_version: weights}, f"TP {m}")


@pytest.mark.parametrize("m", [2, 3])
def test_a_committed_version_reads_back_and_computes_like_the_single_process_model(engines, m):
    """commit_weights(v + 1): read_weights gathers it back bit for bit, and new requests compute what the
    single-process model computes on it (a rank left on the old shards fails both)."""
    engine = engines(m)
    version = engine.weight_version + 1
    new = fresh_weights(engine, seed=100 + version)
    engine.commit_weights(new, version)
    assert engine.weight_version == version
    assert_bitwise_equal(new, engine.read_weights(), f"TP {m} after committing version {version}", RERUN)
    for i, p in enumerate(PROMPTS[:2]):
        s = engine.submit(GenerationRequest(f"after-{version}-{i}", p, 10))
        s.result(WAIT_S)
        assert_computes_like(engine.shape, s, {version: new}, f"TP {m}, version {version}")


def test_a_partial_update_keeps_the_rest_and_moves_a_tied_head_with_its_embedding(engines):
    engine = engines(3)
    before = engine.read_weights()
    version = engine.weight_version + 1
    embed = {"model.embed_tokens.weight": fresh_weights(engine, seed=7)["model.embed_tokens.weight"]}
    engine.commit_weights(embed, version)
    after = {**before, **embed}
    assert_bitwise_equal(after, engine.read_weights(), "TP 3 after an embedding-only version", RERUN)
    s = engine.submit(GenerationRequest("tied", PROMPTS[0], 10))
    s.result(WAIT_S)
    assert_computes_like(engine.shape, s, {version: after}, "TP 3, tied head, embedding-only version")


# ------------------------------------------------------------------------------------------ versions
def test_a_version_is_committed_on_every_rank_or_on_none(engines):
    """Rank 0 alone staged the version: the vote fails, no rank commits it, each is named with what it
    staged, and the engine serves the old version bit for bit."""
    engine = engines(2)
    before, version = engine.read_weights(), engine.weight_version
    shards = engine.read_shards()[0]
    with pytest.raises(PartialCommitError, match="rank 1: staged version -1") as err:
        engine.rank.stage(version + 1, shards)
        engine.commit_staged(version + 1, list(shards))
    assert err.value.versions == [version, version], f"live versions per rank {err.value.versions}"
    assert engine.weight_version == version
    assert_bitwise_equal(before, engine.read_weights(), "TP 2 after a refused commit", RERUN)


def test_stale_versions_and_partial_fused_groups_are_refused(engines):
    engine = engines(2)
    version = engine.weight_version
    new = fresh_weights(engine, seed=3)
    with pytest.raises(VersionError, match=f"not newer than the committed {version}"):
        engine.commit_weights(new, version)
    with pytest.raises(ManifestMismatch, match="k_proj"):
        engine.commit_weights(
            {"model.layers.0.self_attn.q_proj.weight": new["model.layers.0.self_attn.q_proj.weight"]},
            version + 1,
        )
    assert engine.weight_version == version


@pytest.mark.not_quick  # 1.1 s
def test_an_update_committed_mid_stream_stamps_each_token_with_the_one_version_all_ranks_ran(engines):
    """A commit lands between two steps of running requests (no pause): each token is stamped with one
    version, the stamps of a request never go back, and every token equals the single-process model's
    with the stamped version's weights (over the KV the earlier ones computed): no token mixes shards of
    two versions."""
    engine = engines(2)
    old, v_old = engine.read_weights(), engine.weight_version
    streams = in_flight(engine, "mid-stream", max_tokens=30)
    new = fresh_weights(engine, seed=200 + v_old)
    engine.commit_weights(new, v_old + 1)
    for s in streams:
        c = s.result(WAIT_S)
        assert c.token_versions == sorted(c.token_versions), f"{c.request_id}: versions {c.token_versions}"
        assert set(c.token_versions) <= {v_old, v_old + 1}, f"{c.request_id}: versions {c.token_versions}"
        assert_computes_like(engine.shape, s, {v_old: old, v_old + 1: new}, "commit mid-stream")
    assert any(v_old + 1 in s.result(0).token_versions for s in streams), "no token after the commit"


# ------------------------------------------------------------------------------------------ pause modes
def test_pause_abort_ends_requests_in_flight_with_their_tokens(engines):
    engine = engines(2)
    weights, version = engine.read_weights(), engine.weight_version
    streams = in_flight(engine, "abort")
    engine.pause("abort")
    try:
        for s in streams:
            c = s.result(WAIT_S)
            assert c.finish_reason == "abort", f"{c.request_id}: finish {c.finish_reason}"
            assert 2 <= len(c.token_ids) < 40, f"{c.request_id}: {len(c.token_ids)} tokens at abort"
            assert_computes_like(engine.shape, s, {version: weights}, "aborted request")
    finally:
        engine.resume()
    s = engine.submit(GenerationRequest("after-abort", PROMPTS[0], 5))
    assert s.result(WAIT_S).finish_reason == "length"


def test_pause_wait_finishes_in_flight_requests_on_the_old_version_and_queues_the_rest(engines):
    """pause(wait) returns once the requests in flight finished, every token of each on the old version;
    those sent while paused run after a commit and resume, every token on the new one."""
    engine = engines(2)
    old, v_old = engine.read_weights(), engine.weight_version
    streams = in_flight(engine, "wait", max_tokens=16, tokens=1)
    engine.pause("wait")
    assert all(s.done for s in streams), "pause(wait) returned with requests unfinished"
    queued = [engine.submit(GenerationRequest(f"queued-{i}", p, 8)) for i, p in enumerate(PROMPTS)]
    new = fresh_weights(engine, seed=300 + v_old)
    engine.commit_weights(new, v_old + 1)
    assert not any(s.token_count for s in queued), "a request sent while paused ran before resume"
    engine.resume()
    for s in streams:
        assert s.result(0).versions_seen == {v_old}, f"{s.request.request_id}: {s.result(0).token_versions}"
        assert_computes_like(engine.shape, s, {v_old: old}, "finished under pause(wait)")
    for s in queued:
        assert s.result(WAIT_S).versions_seen == {v_old + 1}
        assert_computes_like(engine.shape, s, {v_old + 1: new}, "sent while paused")


def test_pause_keep_freezes_requests_through_a_commit_and_resumes_them_over_their_kv(engines):
    """pause(keep), commit, resume: no token while paused; the tokens before the pause are the old
    version's, those after it the new one's over the KV cache the old one computed, on every rank."""
    engine = engines(2)
    old, v_old = engine.read_weights(), engine.weight_version
    streams = in_flight(engine, "keep", max_tokens=20)
    engine.pause("keep")
    frozen = [s.token_count for s in streams]
    new = fresh_weights(engine, seed=400 + v_old)
    engine.commit_weights(new, v_old + 1)
    assert [s.token_count for s in streams] == frozen, (
        f"tokens while paused: {frozen} then {[s.token_count for s in streams]}"
    )
    engine.resume()
    for s, at_pause in zip(streams, frozen):
        c = s.result(WAIT_S)
        assert c.finish_reason == "length" and len(c.token_ids) == 20, f"{c.request_id}: {c}"
        want = [v_old] * at_pause + [v_old + 1] * (20 - at_pause)
        assert c.token_versions == want, f"{c.request_id}: versions {c.token_versions}, paused at {at_pause}"
        assert_computes_like(engine.shape, s, {v_old: old, v_old + 1: new}, "kept through a commit")


# ------------------------------------------------------------------------------------------ rank faults
def test_a_worker_rank_slow_to_build_is_waited_for_at_start_not_timed_out_by_the_first_command():
    """A worker rank that takes longer than the group timeout to build its rank after it came up (on a GPU
    its CUDA context, beside other processes making theirs: the H100 run's first command timed out on it,
    and the engine failed before it served anything) is waited for while the engine starts (bounded by
    the start's own bound), so the first command finds every rank in its loop."""
    engine = TPReferenceEngine(TP_MODEL, tp=2, timeout_s=1.0, rank_impl="fixtures.tp_ranks:SlowToBuildRank")
    try:
        (done,) = engine.generate([GenerationRequest("first", PROMPTS[0], 2)])
        assert done.finish_reason == "length" and engine.failure is None, (done, engine.failure)
    finally:
        engine.shutdown()


@pytest.mark.serial
@pytest.mark.not_quick  # 1.2 s killed, 5.2 s stopped (the group timeout)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_or_hung_rank_fails_the_engine_in_bounded_time_naming_it(sig):
    """Rank 1 SIGKILLed (its sockets close) or SIGSTOPped (it never answers) mid-generation: every request
    ends aborted within the group timeout (plus the 2 s a dead rank gets to be reaped), the failure and
    every later call name rank 1 and its state, and shutdown leaves no rank process."""
    timeout_s = 3.0
    engine = TPReferenceEngine(TP_MODEL, tp=2, timeout_s=timeout_s, rank_impl=RANK)
    pid = engine.rank_pids()[0]
    try:
        streams = in_flight(engine, "fault", max_tokens=10_000)
        t0 = time.monotonic()
        os.kill(pid, sig)
        for s in streams:
            c = s.result(timeout_s + 10)
            assert c.finish_reason == "abort", f"{c.request_id}: finish {c.finish_reason}"
        took = time.monotonic() - t0
        assert took < timeout_s + 5, f"requests ended {took:.1f}s after the fault (timeout {timeout_s}s)"
        state = "killed by SIGKILL" if sig == signal.SIGKILL else "state T"
        assert engine.failure and f"rank 1 (pid {pid})" in engine.failure and state in engine.failure, (
            engine.failure
        )
        with pytest.raises(EngineStateError, match=f"rank 1 \\(pid {pid}\\)"):
            engine.submit(GenerationRequest("after-fault", PROMPTS[0], 2))
    finally:
        engine.shutdown()
    assert not pid_alive(pid), f"rank 1 (pid {pid}) outlived shutdown"
