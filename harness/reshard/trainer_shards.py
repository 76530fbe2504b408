"""The trainer's shards as torch's own APIs make them: FSDP2's `fully_shard` on a Llama-shaped
nn.Module (every parameter Shard(0) over the mesh), or `distribute_tensor` per parameter with the
layout's placements (Shard(0), or Replicate() for the norms). The local tensors come from `to_local()`."""

from __future__ import annotations

import torch
from torch import nn

from harness.reshard.layout import REPLICATE, SHARD0, ModelShape, TrainerLayout

FSDP2, DTENSOR = "fsdp2", "dtensor"


class _Attention(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.q_proj = nn.Linear(s.hidden, q, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.hidden, kv, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden, kv, bias=s.qkv_bias)
        self.o_proj = nn.Linear(q, s.hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)


class _Layer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(s.hidden)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = nn.RMSNorm(s.hidden)
        self.mlp = _MLP(s)


class _Body(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)


class TinyLlama(nn.Module):
    """Hugging Face Llama's parameter names and shapes (no forward: only the parameters are synced)."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.model = _Body(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def build_model(shape: ModelShape, full: dict[str, torch.Tensor]) -> TinyLlama:
    """A TinyLlama holding exactly `full` (dtype and bits)."""
    module = TinyLlama(shape).to(next(iter(full.values())).dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(full[name])
    return module


def fsdp2_shards(shape: ModelShape, full: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """FSDP2 as a trainer applies it: fully_shard on every decoder layer, then on the root."""
    from torch.distributed.fsdp import fully_shard

    module = build_model(shape, full)
    for layer in module.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return _locals(module.named_parameters(), {})


def dtensor_shards(layout: TrainerLayout, full: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """distribute_tensor per parameter with the layout's placement (Shard(0) or Replicate())."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = {p.name: p.placement for p in layout.params}
    named = [
        (
            p.name,
            distribute_tensor(full[p.name], mesh, [Replicate() if p.placement == REPLICATE else Shard(0)]),
        )
        for p in layout.params
    ]
    return _locals(named, placements)


def _locals(named, placements: dict[str, str]) -> dict[str, torch.Tensor]:
    """{name: local shard}, each placement checked against the layout's (FSDP2: Shard(0) everywhere)."""
    out = {}
    for name, p in named:
        got = p.placements[0]
        want = placements.get(name, SHARD0)
        if not (got.is_replicate() if want == REPLICATE else got.is_shard(0)) or len(p.placements) != 1:
            raise ValueError(f"{name}: torch placed it {p.placements}, the layout says {want}")
        out[name] = p.to_local().detach()
    return out


def trainer_shards(api: str, shape: ModelShape, layout: TrainerLayout, full, mesh) -> dict[str, torch.Tensor]:
    if api == FSDP2:
        return fsdp2_shards(shape, full, mesh)
    if api == DTENSOR:
        return dtensor_shards(layout, full, mesh)
    raise ValueError(f"unknown trainer API {api!r}: expected {FSDP2!r} or {DTENSOR!r}")
