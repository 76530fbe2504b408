"""A small pure-torch Llama-style decoder: fused qkv and gate_up, RoPE, GQA, optional tied embeddings.

Checkpoint names are the Hugging Face Llama names (q_proj, k_proj, ... as a trainer holds them); the
live model keeps them fused (qkv_proj, gate_up_proj) as vLLM does, so a sync path must deliver a
fused group whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from harness.api import TensorSpec


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# fused live name suffix -> the checkpoint suffixes it is built from, in row order
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def checkpoint_spec(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Checkpoint (trainer-side) names and shapes, in a stable order."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    spec: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec((cfg.vocab_size, d), cfg.dtype)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        spec[p + "input_layernorm.weight"] = TensorSpec((d,), cfg.dtype)
        spec[p + "self_attn.q_proj.weight"] = TensorSpec((cfg.num_heads * hd, d), cfg.dtype)
        spec[p + "self_attn.k_proj.weight"] = TensorSpec((cfg.num_kv_heads * hd, d), cfg.dtype)
        spec[p + "self_attn.v_proj.weight"] = TensorSpec((cfg.num_kv_heads * hd, d), cfg.dtype)
        spec[p + "self_attn.o_proj.weight"] = TensorSpec((d, cfg.num_heads * hd), cfg.dtype)
        spec[p + "post_attention_layernorm.weight"] = TensorSpec((d,), cfg.dtype)
        spec[p + "mlp.gate_proj.weight"] = TensorSpec((f, d), cfg.dtype)
        spec[p + "mlp.up_proj.weight"] = TensorSpec((f, d), cfg.dtype)
        spec[p + "mlp.down_proj.weight"] = TensorSpec((d, f), cfg.dtype)
    spec["model.norm.weight"] = TensorSpec((d,), cfg.dtype)
    if not cfg.tie_word_embeddings:
        spec["lm_head.weight"] = TensorSpec((cfg.vocab_size, d), cfg.dtype)
    return spec


def hf_config(cfg: ModelConfig) -> dict:
    """The same model as a Hugging Face Llama config: transformers computes what this module does
    (an independent implementation for the suites to score the engine against)."""
    return {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": str(cfg.dtype).removeprefix("torch."),
    }


def init_checkpoint(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights by checkpoint name (norm weights near 1, matrices ~ N(0, 0.02))."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, s in checkpoint_spec(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(s.shape, generator=gen)
        else:
            t = 0.2 * torch.randn(s.shape, generator=gen)
        out[name] = t.to(s.dtype)
    return out


def fuse(checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> live (fused) names. Unfused tensors are shared, fused ones concatenated."""
    live: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    for name in checkpoint:
        for fused, parts in FUSED_GROUPS.items():
            if name.endswith(parts[0]):
                prefix = name[: -len(parts[0])]
                live[prefix + fused] = torch.cat([checkpoint[prefix + p] for p in parts], dim=0)
                consumed.update(prefix + p for p in parts)
    for name, t in checkpoint.items():
        if name not in consumed:
            live[name] = t
    return live


def unfuse(live: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Live names -> checkpoint names, slicing fused tensors by the config's row counts."""
    spec = checkpoint_spec(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in live.items():
        for fused, parts in FUSED_GROUPS.items():
            if name.endswith(fused):
                prefix = name[: -len(fused)]
                rows = [spec[prefix + p].shape[0] for p in parts]
                for p, chunk in zip(parts, torch.split(t, rows, dim=0)):
                    out[prefix + p] = chunk
                break
        else:
            out[name] = t
    return out


KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): [kv_heads, seq, head_dim]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * w


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin at `positions` ([T, head_dim / 2]): made once per forward and shared by every
    layer's queries and keys (the tiny models spend most of a decode step in small ops like these)."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    ang = positions.float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def _rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [heads, T, head_dim], rotated by `tables` (rope_tables at its positions)."""
    hd = x.shape[-1]
    cos, sin = tables
    xf = x.float()
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention(
    qkv: torch.Tensor,
    pos: torch.Tensor,
    cached: tuple[torch.Tensor, torch.Tensor] | None,
    heads: tuple[int, int, int],
    theta: float,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal GQA attention of the rows of `qkv` (at positions `pos`) after the `cached` keys and values,
    RoPE applied (`tables`: rope_tables(pos, ...), made here where not given); `heads` = (query heads, kv
    heads, head dim). Returns the heads' outputs side by side ([T, heads * head dim]) and the grown (k, v)."""
    nh, nkv, hd = heads
    tables = tables if tables is not None else rope_tables(pos, hd, theta)
    q, k, v = torch.split(qkv, [nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = _rope(q.view(-1, nh, hd).transpose(0, 1), tables)
    k = _rope(k.view(-1, nkv, hd).transpose(0, 1), tables)
    v = v.view(-1, nkv, hd).transpose(0, 1)
    if cached is not None:
        k = torch.cat([cached[0], k], dim=1)
        v = torch.cat([cached[1], v], dim=1)
    rep = nh // nkv
    kk, vv = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    # query t sits at absolute position start+t and sees keys 0..start+t
    mask = torch.arange(k.shape[1], device=qkv.device)[None, :] <= pos[:, None]
    attn = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    return attn.transpose(0, 1).reshape(-1, nh * hd), (k, v)


@torch.inference_mode()
def forward(
    cfg: ModelConfig, live: Mapping[str, torch.Tensor], tokens: list[int], cache: KVCache | None
) -> tuple[torch.Tensor, KVCache]:
    """Logits of the last position for `tokens` appended after `cache`; returns the grown cache."""
    start = 0 if not cache else cache[0][0].shape[1]
    dev = live["model.embed_tokens.weight"].device  # the engine's device: every step stays on it
    ids = torch.tensor(tokens, dtype=torch.long, device=dev)
    pos = torch.arange(start, start + len(tokens), device=dev)
    x = live["model.embed_tokens.weight"][ids]
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    tables = rope_tables(pos, hd, cfg.rope_theta)
    new_cache: KVCache = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, live[p + "input_layernorm.weight"], cfg.rms_eps)
        qkv = h @ live[p + "self_attn.qkv_proj.weight"].T
        attn, kv = attention(qkv, pos, cache[i] if cache else None, (nh, nkv, hd), cfg.rope_theta, tables)
        new_cache.append(kv)
        x = x + attn @ live[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, live[p + "post_attention_layernorm.weight"], cfg.rms_eps)
        gate, up = torch.split(h @ live[p + "mlp.gate_up_proj.weight"].T, cfg.intermediate_size, dim=-1)
        x = x + (F.silu(gate) * up) @ live[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x[-1:], live["model.norm.weight"], cfg.rms_eps)
    # a tied model computes with its embedding, unless an engine materialised a head of its own
    head = live["lm_head.weight"] if "lm_head.weight" in live else live["model.embed_tokens.weight"]
    return (x @ head.T)[0].float(), new_cache
