"""What every engine shard must hold, cut from the full weights with torch's own splits and none of the
plan's arithmetic: the judge of a resharded sync (and of the plan)."""

from __future__ import annotations

import torch

from harness.reshard.layout import COLUMN, MERGED, QKV, REPLICATED, ROW, VOCAB, EngineLayout


def expected_engine_shards(
    full: dict[str, torch.Tensor], layout: EngineLayout, rank: int
) -> dict[str, torch.Tensor]:
    """{live name: the tensor engine `rank` must hold}, tied names included (their tensor is the one
    they are tied to). vLLM's cuts: tensor_split into m equal parts along dim 0 (column, fused parts,
    padded vocab) or dim 1 (row); kv heads each held by m // kv_heads ranks when m exceeds them."""
    model, m = layout.model, layout.n_ranks
    out = {}
    for p in layout.params:
        src = [full[s] for s in p.sources]
        if p.kind == REPLICATED:
            out[p.name] = src[0]
        elif p.kind == COLUMN:
            out[p.name] = torch.tensor_split(src[0], m, dim=0)[rank]
        elif p.kind == ROW:
            out[p.name] = torch.tensor_split(src[0], m, dim=1)[rank]
        elif p.kind == VOCAB:
            padded = torch.zeros((model.padded_vocab(m), *src[0].shape[1:]), dtype=src[0].dtype)
            padded[: src[0].shape[0]] = src[0]
            out[p.name] = torch.tensor_split(padded, m, dim=0)[rank]
        elif p.kind == MERGED:
            out[p.name] = torch.cat([torch.tensor_split(t, m, dim=0)[rank] for t in src])
        elif p.kind == QKV:
            q, k, v = src
            if m >= model.kv_heads:
                head = rank // (m // model.kv_heads)
                kv = [torch.tensor_split(t, model.kv_heads, dim=0)[head] for t in (k, v)]
            else:
                kv = [torch.tensor_split(t, m, dim=0)[rank] for t in (k, v)]
            out[p.name] = torch.cat([torch.tensor_split(q, m, dim=0)[rank], *kv])
        else:
            raise ValueError(f"{p.name}: unknown split kind {p.kind!r}")
    return out
