"""Resharded sync (issue 28): the trainer's FSDP2 / DTensor shards over N ranks land in vLLM-style
tensor-parallel engine shards over M ranks, every engine shard equal bit for bit to its slice of the
full weights (fused qkv with GQA, gate_up, padded vocab, tied lm_head), with each byte moved once per
engine shard that holds it.

Two tiers: the plan's arithmetic in one process (many drawn layouts, the same cuts as the wire: TP 1, 2,
4 and 8, N from 1 to 8 trainer ranks, kv heads fewer than, equal to and more than the TP ranks, vocab
padding that leaves the last ranks padding only), and real syncs over gloo between N trainer and M
engine processes whose shards torch's own `fully_shard` and `distribute_tensor` made (a few drawn models
per world; the 3 -> 8 world is in the slow tier: 11 processes take 40 s to start on 2 cores). The planner under test is
harness.reshard.plan:build_plan unless WEIGHTSYNC_RESHARD_PLANNER names another (`pkg.module:function`
taking the trainer and engine layouts).

    pytest suites/conformance/test_reshard.py
    WEIGHTSYNC_RESHARD_PLANNER=suites.meta.broken_reshard:off_by_one_row_planner pytest suites/conformance/test_reshard.py
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fixtures.reshard_shapes import (
    DTYPES,
    KV_EQUAL,
    KV_FEWER,
    KV_MORE,
    RANKS,
    TP_SIZES,
    TRAINER_APIS,
    kv_relation,
    model_shapes,
)
from harness.checks import bitwise_mismatches
from harness.pytest_plugin import outcomes_of
from harness.reshard.layout import QKV, ModelShape, engine_layout, full_weights, trainer_layout
from harness.reshard.oracle import expected_engine_shards
from harness.reshard.plan import ReshardPlan
from harness.reshard.sync import BROADCAST, P2P, WIRE_PLANES, choose_data_plane, chunk_locals, simulate
from harness.reshard.world import ReshardWorld, job

PLANNER_ENV = "WEIGHTSYNC_RESHARD_PLANNER"
PLANNER = os.environ.get(PLANNER_ENV, "harness.reshard.plan:build_plan")
#: Gloo worlds (N trainer, M engine ranks): every N <= 3 against TP 1 and 2, then 3 -> 4 (neither divides
#: the other; 7 processes, about 20 s to start on the loaded 2-core box) and, in the slow tier, 3 -> 8
#: (11 processes, about 40 s)
WORLDS = [(n, m) for n in (1, 2, 3) for m in (1, 2)] + [(3, 4), (3, 8)]
SLOW_WORLDS = {(3, 8)}
#: The weightsync-thorough profile (--weightsync-hypothesis-profile=thorough) draws ten times as many
THOROUGH = settings.get_current_profile_name() == "weightsync-thorough"
#: Drawn layouts per in-process plan test, and drawn models per gloo world (each a job of two versions)
PLAN_EXAMPLES = 3000 if THOROUGH else 300
GLOO_EXAMPLES = 30 if THOROUGH else 3
RERUN = "pytest suites/conformance/test_reshard.py"


def plan_for(model: ModelShape, n: int, m: int, dtype: str, api: str = "fsdp2") -> ReshardPlan:
    """The plan the selected planner makes for `model` between N trainer and M engine ranks (the
    dtensor trainer API keeps the norms Replicate(), FSDP2 shards everything)."""
    module, _, name = PLANNER.partition(":")
    planner = getattr(importlib.import_module(module), name)
    return planner(trainer_layout(model, n, dtype, replicate_norms=api == "dtensor"), engine_layout(model, m))


def shard_problems(plan: ReshardPlan, full, engines) -> list[str]:
    """One line per engine shard that is not its slice of `full` bit for bit (which rank, which
    parameter, the first differing element)."""
    return [
        f"engine rank {e}: {p}"
        for e in range(plan.n_engines)
        for p in bitwise_mismatches(expected_engine_shards(full, plan.engine, e), engines[e].tensors)
    ]


# ---------------------------------------------------------------------------------- the plan, in process
@settings(max_examples=PLAN_EXAMPLES, deadline=None)
@given(ranks=RANKS, dtype=DTYPES, api=TRAINER_APIS, data=st.data())
def test_plan_fills_every_engine_shard_bit_for_bit(ranks, dtype, api, data):
    n, m = ranks
    model = data.draw(model_shapes(m), label="model")
    event(f"TP {m}, kv heads {kv_relation(model.kv_heads, m)}")
    plan = plan_for(model, n, m, dtype, api)
    full = full_weights(model, dtype, seed=1)
    problems = shard_problems(plan, full, simulate(plan, chunk_locals(plan, full)))
    assert not problems, (
        f"{n} trainer -> {m} engine ranks, {dtype}, {model} (kv heads {kv_relation(model.kv_heads, m)} "
        f"than TP ranks): {len(problems)} engine shard(s) wrong:\n  "
        + "\n  ".join(problems[:8])
        + f"\nrerun: {RERUN} -k plan_fills"
    )


@settings(max_examples=PLAN_EXAMPLES, deadline=None)
@given(ranks=RANKS, dtype=DTYPES, api=TRAINER_APIS, data=st.data())
def test_plan_moves_each_byte_once_per_engine_shard_that_holds_it(ranks, dtype, api, data):
    n, m = ranks
    model = data.draw(model_shapes(m), label="model")
    plan = plan_for(model, n, m, dtype, api)
    covered: dict[tuple[int, str], list[int]] = {}
    for t in plan.transfers:
        cover = covered.setdefault((t.dst, t.dest), [0] * (t.dst_bytes[1] + 1))
        cover.extend([0] * (t.dst_bytes[1] - len(cover)))
        for b in range(*t.dst_bytes):
            cover[b] += 1
    twice = {k: c.index(max(c)) for k, c in covered.items() if max(c) > 1}
    assert not twice, (
        f"{model}, {n}->{m}: bytes written more than once (engine rank, shard: first byte): {twice}"
    )
    planned, minimum = plan.bytes_per_rank(), plan.minimum_bytes()
    over = {k: (planned[k], minimum[k]) for k in minimum if k != "total" and planned[k] != minimum[k]}
    assert not over, (
        f"{model}, {n}->{m}: engine rank bytes (planned, minimum) differ: {over}\n{plan.bytes_table()}"
    )
    sent = sum(planned[f"trainer {r}"] for r in range(n))
    assert sent == minimum["total"], (
        f"trainers send {sent} B, the engines need {minimum['total']} B\n{plan.bytes_table()}"
    )


@settings(max_examples=PLAN_EXAMPLES // 3, deadline=None)
@given(ranks=RANKS, dtype=DTYPES, data=st.data())
def test_plan_is_deterministic_and_round_trips_json(ranks, dtype, data):
    n, m = ranks
    model = data.draw(model_shapes(m), label="model")
    plan = plan_for(model, n, m, dtype)
    again = plan_for(model, n, m, dtype)
    assert plan.dumps() == again.dumps(), f"{model}, {n}->{m}: two plans from the same layouts differ"
    back = ReshardPlan.from_json(plan.to_json())
    assert back == plan, f"{model}, {n}->{m}: the plan read back from JSON differs from the plan"


def tp_case(m: int, relation: str) -> ModelShape:
    """A model for TP `m` with kv heads `relation` to it (fewer: 2 kv heads, each on m / 2 ranks, or 1 on
    both ranks at TP 2; equal; more: 2m), vocab 100 padded to 128 (at TP 8: rank 6 holds 4 real rows and
    12 of padding, rank 7 padding only; at TP 4 rank 3 holds 4 real rows), hidden 7 (3 and 6 trainer
    ranks cut it unevenly)."""
    kv = {KV_FEWER: 2 if m >= 4 else 1, KV_EQUAL: m, KV_MORE: 2 * m}[relation]
    return ModelShape(
        vocab=100,
        hidden=7,
        heads=2 * m,
        kv_heads=kv,
        head_dim=3,
        intermediate=3 * m,
        layers=1,
        tied=relation != KV_EQUAL,
        qkv_bias=True,
    )


#: Every TP size against every kv relation it allows (TP 1 has no kv head to replicate), from 3 and 6
#: trainer ranks: each case drawn above by chance is here for certain
TP_CASES = [
    (n, m, r)
    for m in TP_SIZES
    for r in (KV_FEWER, KV_EQUAL, KV_MORE)
    if m > 1 or r != KV_FEWER
    for n in (3, 6)
]


@pytest.mark.parametrize(("n", "m", "relation"), TP_CASES, ids=[f"{n}x{m}-kv-{r}" for n, m, r in TP_CASES])
def test_every_tp_size_and_kv_relation_fills_its_shards_with_the_minimum_bytes(n, m, relation):
    model = tp_case(m, relation)
    assert kv_relation(model.kv_heads, m) == relation
    plan = plan_for(model, n, m, "bfloat16")
    full = full_weights(model, "bfloat16", seed=5)
    problems = shard_problems(plan, full, simulate(plan, chunk_locals(plan, full)))
    assert not problems, (
        f"{n} trainer -> {m} engine ranks, {model}: {len(problems)} engine shard(s) wrong:\n  "
        + "\n  ".join(problems[:8])
        + f"\nrerun: {RERUN} -k '{n}x{m}-kv-{relation}'"
    )
    planned, minimum = plan.bytes_per_rank(), plan.minimum_bytes()
    assert {k: planned[k] for k in minimum if k != "total"} == {
        k: v for k, v in minimum.items() if k != "total"
    }, f"{model}, {n}->{m}: planned bytes per engine rank are not the minimum\n{plan.bytes_table()}"
    assert sum(planned[f"trainer {r}"] for r in range(n)) == minimum["total"], plan.bytes_table()


def vllm_kv_heads(rank: int, tp: int, kv_heads: int) -> list[int]:
    """The kv heads TP rank `rank` loads, as vLLM's QKVParallelLinear does: with tp >= kv_heads,
    num_kv_head_replicas = tp // kv_heads and the rank loads head rank // num_kv_head_replicas, which is
    rank * kv_heads // tp (consecutive ranks share a head); else kv_heads // tp heads, in order."""
    if tp >= kv_heads:
        return [rank * kv_heads // tp]
    per = kv_heads // tp
    return list(range(rank * per, (rank + 1) * per))


KV_CASES = [(m, kv) for m in TP_SIZES for kv in (1, 2, 4, 8, 16) if kv % m == 0 or m % kv == 0]


@pytest.mark.parametrize(("m", "kv"), KV_CASES, ids=[f"tp{m}-kv{kv}" for m, kv in KV_CASES])
def test_the_oracle_puts_each_kv_head_on_the_ranks_vllm_loads_it_on(m, kv):
    """The judge itself against vLLM's rule: k_proj / v_proj rows filled with their head's number, each
    rank's k and v rows of qkv_proj hold exactly the heads vLLM's weight loader gives that rank."""
    head_dim, heads = 2, max(m, kv) * 2
    model = ModelShape(vocab=8, hidden=3, heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=m)
    full = full_weights(model, "float32", seed=0)
    a = "model.layers.0.self_attn"
    for i, x in enumerate("kv"):
        ids = torch.arange(kv, dtype=torch.float32).repeat_interleave(head_dim) + 100 * i
        full[f"{a}.{x}_proj.weight"] = ids[:, None].expand(kv * head_dim, model.hidden).clone()
    layout = engine_layout(model, m)
    assert [p.kind for p in layout.params if p.name == f"{a}.qkv_proj.weight"] == [QKV]
    q_rows = heads * head_dim // m
    for rank in range(m):
        qkv = expected_engine_shards(full, layout, rank)[f"{a}.qkv_proj.weight"]
        want = vllm_kv_heads(rank, m, kv)
        k, v = qkv[q_rows:].split(len(want) * head_dim)
        got = [sorted({int(x) for x in t[:, 0].tolist()}) for t in (k, v)]
        assert got == [want, [100 + h for h in want]], (
            f"TP {m}, {kv} kv heads: rank {rank} holds k heads {got[0]}, v heads {got[1]}; vLLM loads "
            f"kv heads {want} there"
        )


def test_plan_table_names_every_transfer_and_the_minimum(record_property):
    model = ModelShape(vocab=70, qkv_bias=True)
    plan = plan_for(model, 3, 2, "bfloat16")
    table = plan.table()
    record_property("reshard_plan", table)  # junit.xml, so a report carries the plan
    print(table)
    rows = [line for line in table.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == len(plan.transfers), (
        f"{len(plan.transfers)} transfers, {len(rows)} table rows:\n{table}"
    )
    assert "tied: lm_head.weight is model.embed_tokens.weight" in table, table
    minimum = plan.minimum_bytes()
    assert f"{minimum['total']:>11}" in table.splitlines()[-1], table


# ---------------------------------------------------------------------------------- real syncs over gloo
#: Rank processes the running worlds may hold at once (the least recently used world is closed first):
#: kept all, the seven default worlds held 28 spawned processes (7.3 GiB of RSS) at the default tier's
#: peak; two worlds of 7 and 5 are what the tests come back to. A third world beside them (the replicas'
#: 7) took the default tier's tree to 9.5 GiB, past its 8 GiB bound.
MAX_LIVE_RANKS = 12


def _world_size(key: tuple[int, int, int]) -> int:
    """Rank processes of a world keyed (N, M, replicas)."""
    n, m, replicas = key
    return n + replicas * m


@pytest.fixture(scope="module")
def reshard_worlds():
    """One running world per (N, M, replicas), started on first use, replaced if a job broke it; at most
    MAX_LIVE_RANKS rank processes alive in all (a world alone may hold more)."""
    worlds: dict[tuple[int, int, int], ReshardWorld] = {}  # least recently used first

    def get(n: int, m: int, replicas: int = 1) -> ReshardWorld:
        key = (n, m, replicas)
        w = worlds.pop(key, None)
        if w is not None and w.broken:
            w.close()
            w = None
        if w is None:
            while worlds and sum(map(_world_size, worlds)) + _world_size(key) > MAX_LIVE_RANKS:
                worlds.pop(next(iter(worlds))).close()
            w = ReshardWorld(n, m, replicas=replicas)
        worlds[key] = w
        return w

    yield get
    for w in worlds.values():
        w.close()


@pytest.mark.multiproc
@pytest.mark.not_quick  # 9 s
@pytest.mark.parametrize(
    ("n", "m"),
    [pytest.param(n, m, marks=[pytest.mark.slow] if (n, m) in SLOW_WORLDS else []) for n, m in WORLDS],
    ids=[f"{n}x{m}" for n, m in WORLDS],
)
@settings(max_examples=GLOO_EXAMPLES, deadline=None)
@given(api=TRAINER_APIS, dtype=DTYPES, seed=st.integers(0, 2**16), data=st.data())
def test_sync_over_gloo_fills_every_engine_shard_bit_for_bit(reshard_worlds, n, m, api, dtype, seed, data):
    model = data.draw(model_shapes(m), label="model")
    plan = plan_for(model, n, m, dtype, api)
    run = reshard_worlds(n, m).run(job(model, api, dtype, seed, steps=2, plan=plan))
    assert run.ok, (
        f"{api} {dtype} seed {seed} {model}: the resharded sync failed:\n{run.summary()}\n"
        f"plan:\n{plan.table()}\nrerun: {RERUN} -k '{n}x{m}'"
    )
    minimum = plan.minimum_bytes()
    for step in (0, 1):  # the same plan, reused for a second version
        measured = run.measured_bytes(step)
        planned = plan.bytes_per_rank()
        assert measured == planned, f"step {step}: bytes per rank measured {measured}, planned {planned}"
        over = {e: (measured[f"engine {e}"], minimum[f"engine {e}"]) for e in range(m)}
        over = {e: v for e, v in over.items() if v[0] != v[1]}
        assert not over and sum(measured[f"trainer {t}"] for t in range(n)) == minimum["total"], (
            f"step {step}: engine ranks received (measured, minimum) bytes {over}, the trainers sent "
            f"{sum(measured[f'trainer {t}'] for t in range(n))} B of a {minimum['total']} B minimum\n"
            f"{plan.bytes_table(measured)}"
        )


#: Shapes where the cuts meet their edges, (N, M, id, model): at 3 -> 2, vocab 1 (engine rank 1 holds
#: only padding), hidden 1 (two of three trainer shards of every norm empty), one kv head held by both
#: engine ranks, vocab padding 2; at 3 -> 4, 2 kv heads each held by two ranks (0-1 head 0, 2-3 head 1),
#: vocab 70 padded to 128 (rank 2: 6 real rows and 26 of padding, rank 3 padding only), hidden 5; at
#: 3 -> 8 (slow tier), 2 kv heads each on four ranks, vocab 100 padded to 128 (rank 6: 4 real rows, rank 7
#: padding only)
EDGE_CASES = [
    (
        3,
        2,
        "vocab1-hidden1",
        ModelShape(vocab=1, hidden=1, heads=2, kv_heads=1, head_dim=1, intermediate=2, qkv_bias=True),
    ),
    (
        3,
        2,
        "vocab3-untied",
        ModelShape(
            vocab=3,
            hidden=2,
            heads=2,
            kv_heads=2,
            head_dim=1,
            intermediate=2,
            tied=False,
            vocab_padding=2,
            layers=2,
        ),
    ),
    (
        3,
        4,
        "tp4-kv2",
        ModelShape(vocab=70, hidden=5, heads=4, kv_heads=2, head_dim=3, intermediate=8, qkv_bias=True),
    ),
    (
        3,
        8,
        "tp8-kv2",
        ModelShape(vocab=100, hidden=7, heads=8, kv_heads=2, head_dim=2, intermediate=8, tied=False),
    ),
]


def _edge_marks(n: int, m: int, i: int) -> list:
    """--quick keeps the first edge shape (its 3 -> 2 world starts in seconds); the wider worlds, 7 and 11
    processes on gloo, take 7-16 s each on 2 cores, and the 3 -> 8 one is in the slow tier."""
    return ([pytest.mark.slow] if (n, m) in SLOW_WORLDS else []) + ([pytest.mark.not_quick] if i else [])


@pytest.mark.multiproc
@pytest.mark.parametrize("api", ["fsdp2", "dtensor"])
@pytest.mark.parametrize(
    ("n", "m", "model"),
    [
        pytest.param(n, m, model, id=name, marks=_edge_marks(n, m, i))
        for i, (n, m, name, model) in enumerate(EDGE_CASES)
    ],
)
def test_sync_over_gloo_fills_edge_shards_bit_for_bit(reshard_worlds, n, m, model, api):
    plan = plan_for(model, n, m, "float32", api)
    run = reshard_worlds(n, m).run(job(model, api, "float32", seed=7, steps=1, plan=plan))
    assert run.ok, f"{api} {model}: the resharded sync failed:\n{run.summary()}\nplan:\n{plan.table()}"
    minimum, measured = plan.minimum_bytes(), run.measured_bytes(0)
    assert all(measured[f"engine {e}"] == minimum[f"engine {e}"] for e in range(m)), plan.bytes_table(
        measured
    )


@pytest.mark.multiproc
def test_sync_moves_the_plans_minimum_bytes_per_rank(reshard_worlds, request):
    model = ModelShape(vocab=70, hidden=10, heads=2, kv_heads=1, head_dim=4, intermediate=6, qkv_bias=True)
    plan = plan_for(model, 3, 2, "bfloat16")
    run = reshard_worlds(3, 2).run(job(model, "fsdp2", "bfloat16", steps=1, plan=plan))
    assert run.ok, run.summary()
    measured, minimum = run.measured_bytes(0), plan.minimum_bytes()
    # the results JSON carries the plan and the bytes, so report.md / report.html print them
    outcomes_of(request.config).setdefault(request.node.nodeid, {})["reshard_plan"] = plan.report_record(
        measured
    )
    wrong = {f"engine {e}": (measured[f"engine {e}"], minimum[f"engine {e}"]) for e in range(2)}
    wrong = {k: v for k, v in wrong.items() if v[0] != v[1]}
    assert not wrong, (
        f"engine ranks received (measured, minimum) bytes: {wrong}\n{plan.bytes_table(measured)}"
    )
    sent = sum(measured[f"trainer {t}"] for t in range(3))
    assert sent == minimum["total"], (
        f"trainers sent {sent} B, the minimum is {minimum['total']} B\n{plan.bytes_table(measured)}"
    )


# ------------------------------------------------------------------ engine replicas: the two data planes
REPLICAS = 2


def test_several_replicas_take_the_broadcast_plane_and_the_choice_says_why():
    assert choose_data_plane(1)[0] == P2P, choose_data_plane(1)
    plane, why = choose_data_plane(REPLICAS)
    assert plane == BROADCAST and f"{REPLICAS} replicas" in why, (plane, why)


@pytest.mark.multiproc
@pytest.mark.not_quick
@pytest.mark.parametrize("plane", WIRE_PLANES)
def test_every_replica_gets_every_shard_bit_for_bit_on_either_data_plane(reshard_worlds, plane, request):
    """Each replica's every engine shard is the oracle's, bit for bit, two versions running, whichever data
    plane moved it; each engine rank of each replica receives exactly its minimum; the trainer ranks hand
    the library the plan's bytes once per replica point to point, once in all by broadcast."""
    model = ModelShape(vocab=70, hidden=10, heads=2, kv_heads=1, head_dim=4, intermediate=6, qkv_bias=True)
    plan = plan_for(model, 3, 2, "bfloat16")
    run = reshard_worlds(3, 2, REPLICAS).run(job(model, "fsdp2", "bfloat16", steps=2, plan=plan, plane=plane))
    assert run.ok and run.plane == plane, (
        f"{plane}: the resharded sync to {REPLICAS} replicas failed (plane run: {run.plane}):\n"
        f"{run.summary()}\nrerun: {RERUN} -k 'replica and {plane}'"
    )
    minimum = plan.minimum_bytes()
    copies = REPLICAS if plane == P2P else 1
    for step in (0, 1):
        measured = run.measured_bytes(step)
        wrong = {
            f"engine {e} of replica {q}": (measured.get(f"engine {e} of replica {q}"), minimum[f"engine {e}"])
            for q in range(REPLICAS)
            for e in range(2)
        }
        wrong = {k: v for k, v in wrong.items() if v[0] != v[1]}
        sent = sum(measured[f"trainer {t}"] for t in range(3))
        assert not wrong and sent == copies * minimum["total"], (
            f"{plane} step {step}: engine ranks received (measured, minimum) bytes {wrong}; the trainers "
            f"handed over {sent} B where {copies} x {minimum['total']} B was the plan"
        )
    if plane == BROADCAST:  # the report shows the plan with its data plane and why
        outcomes_of(request.config).setdefault(request.node.nodeid, {})["reshard_plan"] = plan.report_record(
            None, REPLICAS, choose_data_plane(REPLICAS)
        )


# (side, rank of that side): the rank killed, and which ranks of the other side must name it
KILLS = [("trainer", 1), ("engine", 0)]


@pytest.mark.not_quick  # 13 s
@pytest.mark.serial  # the hang must surface within 3x the group timeout
@pytest.mark.multiproc
@pytest.mark.faults
@pytest.mark.parametrize(("side", "rank"), KILLS, ids=[f"{side}{rank}" for side, rank in KILLS])
def test_rank_killed_mid_sync_fails_naming_the_rank_in_bounded_time(side, rank):
    """A rank dies (SIGKILL) once two of its transfers have happened: every rank of the other side that
    exchanges bytes with it fails with a TransferError naming it, and the run ends within the group timeout."""
    timeout_s = 6.0
    model = ModelShape(vocab=70, hidden=12, heads=2, kv_heads=2, head_dim=4, intermediate=8)
    plan = plan_for(model, 3, 2, "bfloat16")
    with ReshardWorld(3, 2, timeout_s=timeout_s) as world:
        run = world.run(job(model, steps=2, plan=plan, kill=(side, rank, 2)), within_s=3 * timeout_s)
    global_rank = rank if side == "trainer" else 3 + rank
    assert run.dead == {global_rank: "killed by SIGKILL"}, (
        f"expected {side} rank {rank} killed, got {run.dead}\n{run.summary()}"
    )
    assert not run.silent, (
        f"ranks gave no answer within {3 * timeout_s:g}s (a hang): {run.silent}\n{run.summary()}"
    )
    assert run.seconds < 2 * timeout_s, (
        f"the failed sync took {run.seconds:.1f}s, over 2x the {timeout_s:g}s timeout"
    )
    if side == "trainer":  # the engine ranks waiting on its bytes
        peers = [3 + e for e in sorted({t.dst for t in plan.transfers if t.src == rank})]
    else:  # the trainer ranks sending it bytes
        peers = sorted({t.src for t in plan.transfers if t.dst == rank})
    for peer in peers:
        error = run.reports[peer].get("error") or ""
        assert error.startswith("TransferError") and f"{side} rank {rank}" in error, (
            f"global rank {peer} exchanges bytes with {side} rank {rank}; its error does not name it: "
            f"{error[:400]!r}\n{run.summary()}"
        )


def test_plan_cli_prints_the_plan_and_its_json(capsys):
    from harness.reshard.__main__ import main

    assert main(["--trainers", "2", "--engines", "2", "--vocab", "40", "--qkv-bias"]) == 0
    table = capsys.readouterr().out
    assert "resharding plan: 2 trainer rank(s) -> 2 engine rank(s)" in table and "minimum B" in table, table
    assert main(["--trainers", "2", "--engines", "2", "--vocab", "40", "--qkv-bias", "--json"]) == 0
    back = ReshardPlan.from_json(json.loads(capsys.readouterr().out))
    want = plan_for(ModelShape(vocab=40, qkv_bias=True), 2, 2, "bfloat16")
    assert back == want, "the CLI's JSON is not the plan build_plan makes for the same model"
