"""Real vLLM with tensor parallelism on CPU (issue 28 item 4): the tiny models served with
tensor_parallel_size=2 (two worker processes of vLLM's "mp" executor), a new version pushed through
vLLM's own weight-update lifecycle with the harness transport, then each TP rank's live shards read back
through its packed kernels and judged bit for bit against harness.reshard.oracle: the split rules the
resharding plan assumes (fused qkv with GQA, gate_up, row-parallel o/down, vocab-parallel embedding and
head, replicated norms, a tied head) checked against a running vLLM.

vLLM's default CPU thread binding refuses two workers on a one-NUMA-node machine (see suites/vllm/README.md);
the engine lists each worker's CPUs in VLLM_CPU_OMP_THREADS_BIND (harness.engines.vllm_settings).

    python -m pytest suites/vllm/test_vllm_tensor_parallel.py -m vllm
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from harness.checks import bitwise_mismatches
from harness.engines.tiny_hf_models import TINY_LLAMA, TINY_QWEN2_TIED, TinyModel, build, random_checkpoint
from harness.reshard.layout import ModelShape, engine_layout
from harness.reshard.oracle import expected_engine_shards

pytestmark = pytest.mark.vllm

TP = 2
MODELS = {"llama": TINY_LLAMA, "qwen2-tied": TINY_QWEN2_TIED}


def shape_of(spec: TinyModel) -> ModelShape:
    """The reshard layer's ModelShape of a tiny HF model (Qwen2 carries a qkv bias)."""
    return ModelShape(
        vocab=spec.vocab_size,
        hidden=spec.hidden_size,
        heads=spec.num_heads,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        intermediate=spec.intermediate_size,
        layers=spec.num_layers,
        tied=spec.tie_word_embeddings,
        qkv_bias=spec.architecture == "qwen2",
    )


@pytest.fixture(scope="module", params=list(MODELS))
def tp_engine(request, tmp_path_factory):
    """(model spec, vLLM serving it with TP=2 in this process's engine core), started once per model."""
    from harness.engines.vllm import InProcessVllm

    spec = MODELS[request.param]
    root = tmp_path_factory.mktemp(f"vllm-tp{TP}-{request.param}")
    engine = InProcessVllm(build(spec, root / "models"), root / "engine", tensor_parallel_size=TP)
    yield spec, engine
    engine.shutdown()


def test_each_tp_rank_holds_its_oracle_shard_bit_for_bit_after_a_push(tp_engine, request):
    spec, engine = tp_engine
    model = shape_of(spec)
    model.check_tp(TP)
    template = {n: s for n, s in engine.weight_spec().items()}
    import torch

    full = random_checkpoint({n: torch.empty(s.shape, dtype=s.dtype) for n, s in template.items()}, seed=28)
    if model.tied:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    version = engine.weight_version + 1
    engine.commit_weights({n: t for n, t in full.items() if n in template}, version)
    assert engine.weight_version == version, f"vLLM serves version {engine.weight_version}, pushed {version}"
    shards = engine.read_shards()
    assert sorted(shards) == list(range(TP)), (
        f"expected one read-back per TP rank 0..{TP - 1}, got {sorted(shards)}"
    )
    layout = engine_layout(model, TP)
    problems = []
    for rank in range(TP):
        expected = expected_engine_shards(full, layout, rank)
        problems += [f"TP rank {rank}: {p}" for p in bitwise_mismatches(expected, shards[rank])]
        extra = sorted(set(shards[rank]) - set(expected))
        if extra:
            problems.append(f"TP rank {rank}: live tensors the oracle does not know: {extra}")
    assert not problems, (
        f"{spec.name} served with TP={TP}: {len(problems)} shard(s) differ from harness.reshard.oracle:\n  "
        + "\n  ".join(problems[:12])
        + f"\nrerun: python -m pytest {request.node.nodeid} -m vllm"
    )
