"""Broken resharding planners the reshard suite must fail (WEIGHTSYNC_RESHARD_PLANNER names one)."""

from __future__ import annotations

import dataclasses

from harness.reshard.layout import QKV, EngineLayout, TrainerLayout
from harness.reshard.plan import ReshardPlan, build_plan, engine_shards


def off_by_one_row(plan: ReshardPlan) -> tuple[ReshardPlan, int]:
    """The plan with one transfer's source rows moved by one row (+1, else -1, inside the trainer's local
    shard where it can; else +1 past its end), and that transfer's index."""
    moves = [(i, d) for d in (1, -1) for i, t in enumerate(plan.transfers) if _fits(plan, t, d)]
    i, d = moves[0] if moves else (0, 1)
    t = plan.transfers[i]
    row = (t.src_bytes[1] - t.src_bytes[0]) // (t.src_rows[1] - t.src_rows[0]) if t.src_bytes else 0
    moved = dataclasses.replace(
        t,
        src_rows=(t.src_rows[0] + d, t.src_rows[1] + d),
        src_bytes=(t.src_bytes[0] + d * row, t.src_bytes[1] + d * row) if t.src_bytes else None,
    )
    return dataclasses.replace(plan, transfers=(*plan.transfers[:i], moved, *plan.transfers[i + 1 :])), i


def _fits(plan: ReshardPlan, t, d: int) -> bool:
    lo, hi = plan.trainer.rows_of(t.source, t.src)
    return t.src_rows[0] + d >= 0 and t.src_rows[1] + d <= hi - lo


def off_by_one_row_planner(trainer: TrainerLayout, engine: EngineLayout) -> ReshardPlan:
    return off_by_one_row(build_plan(trainer, engine))[0]


def kv_heads_round_robin_planner(trainer: TrainerLayout, engine: EngineLayout) -> ReshardPlan:
    """Replicated kv heads on the wrong TP ranks: with kv_heads < M, rank r gets kv head r % kv_heads
    (round robin) where vLLM gives it head r // (M / kv_heads) (blocks of consecutive ranks). Every shard
    has the right size and the bytes per rank are the minimum; only the k and v rows' contents are wrong.
    It is right whenever M <= kv_heads or kv_heads == 1, so TP 1 and 2 cannot tell it from vLLM's rule:
    the first layout that can is TP 4 with 2 kv heads (ranks 1 and 2 swapped)."""
    model, m = engine.model, engine.n_ranks
    shapes = {p.name: p.shape for p in trainer.params}
    shards = [s for r in range(m) for s in engine_shards(engine, shapes, r)]
    if m > model.kv_heads:
        kinds = {p.name: p.kind for p in engine.params}
        hd = model.head_dim
        wrong = []
        for s in shards:
            if kinds[s.name] == QKV:
                head = s.rank % model.kv_heads
                segs = [dataclasses.replace(g, rows=(head * hd, (head + 1) * hd)) for g in s.segments[1:]]
                s = dataclasses.replace(s, segments=(s.segments[0], *segs))
            wrong.append(s)
        shards = wrong
    return build_plan(trainer, engine, shards)
