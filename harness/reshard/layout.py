"""Both sides' layouts of one Llama-shaped model: the trainer's (DTensor placements over N ranks) and
the engine's (vLLM's tensor-parallel split over M ranks).

The trainer side follows torch: Shard(0) cuts dim 0 the way `torch.chunk` does (FSDP2's `fully_shard`
and `distribute_tensor` alike), so with dim0 % N != 0 the last shards are shorter, or empty. The engine
side follows vLLM's layers: ColumnParallelLinear splits dim 0, RowParallelLinear dim 1, norms are
replicated, QKVParallelLinear stacks each rank's q, k and v rows (kv heads replicated when M exceeds
them), MergedColumnParallelLinear stacks gate and up, VocabParallelEmbedding / ParallelLMHead pad the
vocabulary to a multiple of `vocab_padding` and split the padded rows; a tied lm_head is embed_tokens.
"""

from __future__ import annotations

import dataclasses
import math

import torch

#: vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py)
VLLM_VOCAB_PADDING = 64

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# How an engine parameter is split over the TP ranks (vLLM's layer classes)
COLUMN, ROW, REPLICATED, VOCAB, QKV, MERGED = "column", "row", "replicated", "vocab", "qkv", "merged"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped model small enough for a test; `qkv_bias` as Qwen2 has it."""

    vocab: int = 100
    hidden: int = 16
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    intermediate: int = 24
    layers: int = 1
    tied: bool = True
    qkv_bias: bool = False
    vocab_padding: int = VLLM_VOCAB_PADDING

    def check_tp(self, m: int) -> None:
        """Raise ValueError unless vLLM could split this model over `m` TP ranks."""
        problems = []
        if self.heads % m:
            problems.append(f"heads {self.heads} % tp {m} != 0")
        if self.kv_heads % m and m % self.kv_heads:
            problems.append(f"kv_heads {self.kv_heads} and tp {m}: neither divides the other")
        if self.intermediate % m:
            problems.append(f"intermediate {self.intermediate} % tp {m} != 0")
        if self.heads % self.kv_heads:
            problems.append(f"heads {self.heads} % kv_heads {self.kv_heads} != 0")
        if self.padded_vocab(m) % m:
            problems.append(f"padded vocab {self.padded_vocab(m)} % tp {m} != 0")
        if problems:
            raise ValueError(f"{self}: vLLM cannot split it over {m} ranks: {'; '.join(problems)}")

    def padded_vocab(self, m: int) -> int:
        return math.ceil(self.vocab / self.vocab_padding) * self.vocab_padding

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face names and shapes, the trainer's parameters (a tied lm_head is not listed:
        `named_parameters` gives the shared tensor once, as embed_tokens)."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.layers):
            p = f"model.layers.{n}"
            out[f"{p}.input_layernorm.weight"] = (h,)
            out[f"{p}.self_attn.q_proj.weight"] = (q, h)
            out[f"{p}.self_attn.k_proj.weight"] = (kv, h)
            out[f"{p}.self_attn.v_proj.weight"] = (kv, h)
            if self.qkv_bias:
                out[f"{p}.self_attn.q_proj.bias"] = (q,)
                out[f"{p}.self_attn.k_proj.bias"] = (kv,)
                out[f"{p}.self_attn.v_proj.bias"] = (kv,)
            out[f"{p}.self_attn.o_proj.weight"] = (h, q)
            out[f"{p}.post_attention_layernorm.weight"] = (h,)
            out[f"{p}.mlp.gate_proj.weight"] = (i, h)
            out[f"{p}.mlp.up_proj.weight"] = (i, h)
            out[f"{p}.mlp.down_proj.weight"] = (h, i)
        out["model.norm.weight"] = (h,)
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        return out


# ------------------------------------------------------------------------------------------ trainer side
SHARD0, REPLICATE = "Shard(0)", "Replicate()"


@dataclasses.dataclass(frozen=True)
class TrainerParam:
    name: str
    shape: tuple[int, ...]
    placement: str  # SHARD0 or REPLICATE, as DTensor names them


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """Every trainer parameter's global shape and placement over `n_ranks` ranks."""

    n_ranks: int
    dtype: str
    params: tuple[TrainerParam, ...]

    def param(self, name: str) -> TrainerParam:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"trainer layout has no parameter {name!r}")

    def rows_of(self, name: str, rank: int) -> tuple[int, int]:
        """Global rows [start, stop) of dim 0 that trainer `rank` holds of `name`."""
        p = self.param(name)
        rows = p.shape[0]
        if p.placement == REPLICATE:
            return 0, rows
        return chunk_rows(rows, self.n_ranks, rank)


def chunk_rows(rows: int, n: int, rank: int) -> tuple[int, int]:
    """torch.chunk's cut of `rows` into `n`: ceil(rows / n) each, the last ones shorter or empty. This is
    what Shard(0) holds on `rank` (DTensor's Shard._local_shard_size_and_offset, FSDP2's fully_shard)."""
    size = math.ceil(rows / n) if rows else 0
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def trainer_layout(model: ModelShape, n: int, dtype: str, replicate_norms: bool = False) -> TrainerLayout:
    """FSDP2's layout (every parameter Shard(0)); with `replicate_norms` the 1-D norm weights are
    Replicate() (a DTensor layout that keeps small tensors whole on every rank)."""

    def placement(name: str) -> str:
        return REPLICATE if replicate_norms and name.endswith("norm.weight") else SHARD0

    params = tuple(TrainerParam(k, s, placement(k)) for k, s in model.checkpoint_shapes().items())
    return TrainerLayout(n, dtype, params)


# ------------------------------------------------------------------------------------------- engine side
@dataclasses.dataclass(frozen=True)
class EngineParam:
    """One live vLLM parameter: its name, how it is split, the checkpoint tensors it is made of (in row
    order), and for a tied one the live parameter it shares storage with."""

    name: str
    kind: str
    sources: tuple[str, ...]
    tied_to: str | None = None


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """Every live parameter of the engine over `n_ranks` TP ranks, and the model it splits."""

    n_ranks: int
    model: ModelShape
    params: tuple[EngineParam, ...]


def engine_layout(model: ModelShape, m: int) -> EngineLayout:
    """vLLM's live parameters of `model` under tensor parallelism `m` (Llama / Qwen2 layer classes)."""
    model.check_tp(m)
    ps: list[EngineParam] = [EngineParam("model.embed_tokens.weight", VOCAB, ("model.embed_tokens.weight",))]
    for n in range(model.layers):
        p = f"model.layers.{n}"
        a = f"{p}.self_attn"
        ps.append(EngineParam(f"{p}.input_layernorm.weight", REPLICATED, (f"{p}.input_layernorm.weight",)))
        ps.append(EngineParam(f"{a}.qkv_proj.weight", QKV, tuple(f"{a}.{x}_proj.weight" for x in "qkv")))
        if model.qkv_bias:
            ps.append(EngineParam(f"{a}.qkv_proj.bias", QKV, tuple(f"{a}.{x}_proj.bias" for x in "qkv")))
        ps.append(EngineParam(f"{a}.o_proj.weight", ROW, (f"{a}.o_proj.weight",)))
        ps.append(
            EngineParam(
                f"{p}.post_attention_layernorm.weight", REPLICATED, (f"{p}.post_attention_layernorm.weight",)
            )
        )
        ps.append(
            EngineParam(
                f"{p}.mlp.gate_up_proj.weight",
                MERGED,
                (f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"),
            )
        )
        ps.append(EngineParam(f"{p}.mlp.down_proj.weight", ROW, (f"{p}.mlp.down_proj.weight",)))
    ps.append(EngineParam("model.norm.weight", REPLICATED, ("model.norm.weight",)))
    if model.tied:
        ps.append(
            EngineParam(
                "lm_head.weight", VOCAB, ("model.embed_tokens.weight",), tied_to="model.embed_tokens.weight"
            )
        )
    else:
        ps.append(EngineParam("lm_head.weight", VOCAB, ("lm_head.weight",)))
    return EngineLayout(m, model, tuple(ps))


def full_weights(model: ModelShape, dtype: str, seed: int) -> dict[str, torch.Tensor]:
    """The full checkpoint, random bit patterns (NaN payloads, -0.0 and subnormals included), the same
    on every process for the same seed; a tied lm_head.weight is the embed_tokens tensor itself."""
    torch_dtype = DTYPES[dtype]
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[torch.empty((), dtype=torch_dtype).element_size()]
    info = torch.iinfo(bits)
    out = {}
    for i, (name, shape) in enumerate(model.checkpoint_shapes().items()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        out[name] = torch.randint(info.min, info.max, shape, dtype=bits, generator=g).view(torch_dtype)
    if model.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
