"""One tensor-parallel rank's forward pass of the reshard model (`reshard.layout.ModelShape`): the tiny
decoder of `tiny_lm` computed from this rank's engine shards only, as vLLM's parallel layers compute it.

Column-parallel layers (qkv_proj, gate_up_proj) run on the rank's own heads and intermediate rows; the
row-parallel ones (o_proj, down_proj) give partial sums that an all-reduce adds; the vocab-parallel
embedding looks up only the rank's rows (zeros elsewhere) and an all-reduce adds those; the vocab-parallel
lm_head's logits are all-gathered and the padding rows dropped. Norms are replicated: every rank computes
the same residual stream."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F

from harness.engines.tiny_lm import ModelConfig, attention, rope_tables
from harness.engines.tiny_lm import _rms_norm as rms_norm  # the same math as the single-process model
from harness.reshard.layout import DTYPES, ModelShape

#: per layer (K, V) of this rank's kv heads: [local kv heads, seq, head_dim]
RankKVCache = list[tuple[torch.Tensor, torch.Tensor]]

#: RoPE base and RMSNorm epsilon: the single-process model's (tiny_lm.ModelConfig's defaults)
ROPE_THETA, RMS_EPS = ModelConfig.rope_theta, ModelConfig.rms_eps


class Collectives(Protocol):
    """What a forward needs from the TP group: sums and gathers over the M ranks, in place of one device."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


def local_heads(shape: ModelShape, m: int) -> tuple[int, int]:
    """(q heads, kv heads) one rank of `m` computes: its share of the q heads, and of the kv heads or,
    when `m` exceeds them, the one kv head its q heads share (vLLM's replication)."""
    return shape.heads // m, max(shape.kv_heads // m, 1)


def init_weights(shape: ModelShape, dtype: str = "float32", seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights a forward can run on, by checkpoint name (norms near 1, matrices ~ N(0, 0.2), as
    tiny_lm.init_checkpoint draws them); a tied model lists no lm_head.weight."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, s in shape.checkpoint_shapes().items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = (base + (0.1 if base else 0.2) * torch.randn(s, generator=gen)).to(DTYPES[dtype])
    return out


def tiny_lm_config(shape: ModelShape, dtype: str = "float32") -> ModelConfig:
    """The single-process model with the same math, where it exists (tiny_lm has no qkv bias and a head
    dim of hidden / heads): the judge of the TP forward."""
    if shape.qkv_bias or shape.hidden != shape.heads * shape.head_dim:
        raise ValueError(f"{shape}: tiny_lm computes no qkv bias and head_dim = hidden / heads")
    return ModelConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_layers=shape.layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        tie_word_embeddings=shape.tied,
        dtype=DTYPES[dtype],
    )


@torch.inference_mode()
def forward(
    shape: ModelShape,
    rank: int,
    m: int,
    shards: Mapping[str, torch.Tensor],
    tokens: list[int],
    cache: RankKVCache | None,
    comm: Collectives,
) -> tuple[torch.Tensor, RankKVCache]:
    """Logits (float32, the real vocabulary, the same on every rank) of the last position of `tokens`
    appended after `cache`, and this rank's grown cache. Every rank of the group must call it with the
    same tokens: each all-reduce and all-gather waits for all M."""
    start = 0 if not cache else cache[0][0].shape[1]
    embed = shards["model.embed_tokens.weight"]
    ids = torch.tensor(tokens, dtype=torch.long, device=embed.device)
    pos = torch.arange(start, start + len(tokens), device=embed.device)
    rows = embed.shape[0]  # padded vocab / m
    local = ids - rank * rows
    mine = (local >= 0) & (local < rows)
    # vocab-parallel lookup: zeros for ids another rank holds; the all-reduce adds the one real row to zeros
    x = torch.where(
        mine[:, None],
        embed[local.clamp(0, rows - 1)],
        torch.zeros((), dtype=embed.dtype, device=embed.device),
    )
    x = comm.all_reduce(x)
    hd = shape.head_dim
    nh, nkv = local_heads(shape, m)
    tables = rope_tables(pos, hd, ROPE_THETA)
    new_cache: RankKVCache = []
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, shards[p + "input_layernorm.weight"], RMS_EPS)
        qkv = h @ shards[p + "self_attn.qkv_proj.weight"].T
        if shape.qkv_bias:
            qkv = qkv + shards[p + "self_attn.qkv_proj.bias"]
        attn, kv = attention(qkv, pos, cache[i] if cache else None, (nh, nkv, hd), ROPE_THETA, tables)
        new_cache.append(kv)
        # o_proj is row-parallel: this rank's heads times its columns, a partial sum of the full product
        x = x + comm.all_reduce(attn @ shards[p + "self_attn.o_proj.weight"].T)
        h = rms_norm(x, shards[p + "post_attention_layernorm.weight"], RMS_EPS)
        gate_up = h @ shards[p + "mlp.gate_up_proj.weight"].T
        gate, up = torch.split(gate_up, gate_up.shape[-1] // 2, dim=-1)
        x = x + comm.all_reduce((F.silu(gate) * up) @ shards[p + "mlp.down_proj.weight"].T)
    x = rms_norm(x[-1:], shards["model.norm.weight"], RMS_EPS)
    logits = (x @ shards["lm_head.weight"].T)[0].float()
    return torch.cat(comm.all_gather(logits))[: shape.vocab], new_cache
