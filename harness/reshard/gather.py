"""The full checkpoint from M engine ranks' tensor-parallel shards: the oracle's cuts inverted (vocab
padding stripped, q/k/v and gate/up un-stacked, replicated kv heads and norms read once). What a TP
engine's `read_weights` returns; `oracle.expected_engine_shards` then `gather_full` is the identity.

Where M ranks hold copies of the same bytes (norms, kv heads replicated when M exceeds them), the copies
must agree bit for bit, or the gather refuses: a rank that kept an old version of a replicated tensor is
named rather than hidden behind rank 0's copy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from harness.api import ManifestMismatch
from harness.checks import first_difference
from harness.manifest import as_bytes
from harness.reshard.layout import COLUMN, MERGED, QKV, REPLICATED, ROW, VOCAB, EngineLayout


def split_sizes(n: int, m: int) -> list[int]:
    """How `torch.tensor_split(x, m)` cuts n rows: the sizes of its m parts."""
    return [len(part) for part in torch.arange(n).tensor_split(m)]


def _same(name: str, copies: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The one value M ranks hold copies of; ManifestMismatch naming the first rank that differs."""
    (r0, first), *rest = copies
    for r, t in rest:
        if t.shape != first.shape or not torch.equal(as_bytes(t.contiguous()), as_bytes(first.contiguous())):
            raise ManifestMismatch(
                f"{name}: engine rank {r}'s replica differs from rank {r0}'s: {first_difference(first, t)}"
                if t.shape == first.shape
                else f"{name}: engine rank {r} holds shape {tuple(t.shape)}, rank {r0} {tuple(first.shape)}"
            )
    return first


def gather_full(
    layout: EngineLayout, shards: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """{checkpoint name: full tensor} from `shards[r]` = engine rank r's {live name: shard}. A tied
    lm_head is not listed (it is embed_tokens, as the trainer's checkpoint has it)."""
    model, m = layout.model, layout.n_ranks
    if len(shards) != m:
        raise ValueError(f"gather over {m} engine ranks got shards of {len(shards)}")
    shapes = model.checkpoint_shapes()
    out: dict[str, torch.Tensor] = {}
    for p in layout.params:
        if p.tied_to is not None:
            continue
        parts = [s[p.name] for s in shards]
        if p.kind == REPLICATED:
            out[p.sources[0]] = _same(p.name, list(enumerate(parts))).clone()
        elif p.kind == COLUMN:
            out[p.sources[0]] = torch.cat(parts, dim=0)
        elif p.kind == ROW:
            out[p.sources[0]] = torch.cat(parts, dim=1)
        elif p.kind == VOCAB:
            out[p.sources[0]] = torch.cat(parts, dim=0)[: shapes[p.sources[0]][0]].clone()
        elif p.kind == MERGED:
            # each rank stacks its rows of every source: cut them apart, then stack each source's rows
            per_rank = [
                t.split([split_sizes(shapes[s][0], m)[r] for s in p.sources]) for r, t in enumerate(parts)
            ]
            for i, s in enumerate(p.sources):
                out[s] = torch.cat([rows[i] for rows in per_rank], dim=0)
        elif p.kind == QKV:
            out.update(_gather_qkv(p.name, p.sources, parts, model.kv_heads, m, shapes))
        else:
            raise ValueError(f"{p.name}: unknown split kind {p.kind!r}")
    return out


def _gather_qkv(name, sources, parts, kv_heads: int, m: int, shapes) -> dict[str, torch.Tensor]:
    q_name, k_name, v_name = sources
    q_rows = split_sizes(shapes[q_name][0], m)
    kv_total = shapes[k_name][0]
    # kv_heads >= m: rank r holds rows of heads [r*K/m, (r+1)*K/m); else one head, on m / K ranks each
    kv_rows = split_sizes(kv_total, m) if kv_heads >= m else [kv_total // kv_heads] * m
    cut = [t.split([q_rows[r], kv_rows[r], kv_rows[r]]) for r, t in enumerate(parts)]
    out = {q_name: torch.cat([c[0] for c in cut], dim=0)}
    for i, src in ((1, k_name), (2, v_name)):
        if kv_heads >= m:
            out[src] = torch.cat([c[i] for c in cut], dim=0)
        else:
            holders = m // kv_heads  # head h lives on ranks [h * holders, (h + 1) * holders)
            out[src] = torch.cat(
                [
                    _same(
                        f"{name} ({src}, kv head {h})",
                        [(r, cut[r][i]) for r in range(h * holders, (h + 1) * holders)],
                    )
                    for h in range(kv_heads)
                ],
                dim=0,
            )
    return out
