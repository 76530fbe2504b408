"""Delta benchmarks: bytes moved at the trainer's sparsity, extraction and apply time per GB, and
where delta stops paying against dense. Gates are ratios measured in the same run, never times."""

from __future__ import annotations

import time

import pytest
import torch

from harness.engines.tiny_lm import ModelConfig, checkpoint_spec
from harness.paths import delta_codec as codec
from harness.paths.delta import DEFAULT_MAX_SPARSE_FRACTION, encode_delta
from harness.trainer import ReferenceTrainer

# ~45 MB of bf16 policy: big enough that per-call overheads do not dominate, small enough for CI
POLICY = checkpoint_spec(
    ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1408,
        dtype=torch.bfloat16,
    )
)
MAX_DELTA_TO_DENSE = 0.03  # the gate: at ~99% unchanged, delta moves at most 3% of dense bytes


@pytest.fixture(scope="module")
def two_versions():
    trainer = ReferenceTrainer(POLICY, seed=0)
    for _ in range(3):  # past the first steps, where AdamW's moments are still warming
        trainer.step()
    _, old = trainer.step()
    _, new = trainer.step()
    return old, new


def _gb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9


def test_delta_moves_at_most_3_percent_of_dense_at_trainer_sparsity(benchmark, two_versions):
    old, new = two_versions
    payload, entries, stats = benchmark(encode_delta, old, new, DEFAULT_MAX_SPARSE_FRACTION, 2)
    changed = stats.changed_elements / stats.total_elements
    benchmark.extra_info.update(
        moved_over_dense=round(stats.ratio, 5),
        changed_fraction=round(changed, 5),
        dense_bytes=stats.dense_bytes,
        moved_bytes=stats.moved_bytes,
        extract_gb_per_s=round(_gb(new) / benchmark.stats["median"], 3),
    )
    assert changed < 0.02, (
        f"the trainer changed {changed:.2%} of entries per step; the bound assumes about 1%"
    )
    assert stats.ratio <= MAX_DELTA_TO_DENSE, (
        f"delta moved {stats.moved_bytes} of {stats.dense_bytes} dense bytes ({stats.ratio:.2%} > "
        f"{MAX_DELTA_TO_DENSE:.0%}) at {changed:.2%} changed entries"
    )


def test_delta_apply_time_per_gb(benchmark, two_versions):
    old, new = two_versions
    patches = {}
    for name, t in new.items():
        idx = codec.changed_indices(old[name], t)
        patches[name] = (codec.encode_indices(idx, t.numel()), codec.gather_values(t, idx))

    def apply_all():
        return {
            n: codec.apply_patch(old[n], codec.decode_indices(enc, old[n].numel()), vals)
            for n, (enc, vals) in patches.items()
        }

    out = benchmark(apply_all)
    wrong = [n for n in new if not torch.equal(codec.int_view(out[n]), codec.int_view(new[n]))]
    benchmark.extra_info.update(
        apply_gb_per_s=round(_gb(new) / benchmark.stats["median"], 3), wrong=len(wrong)
    )
    assert not wrong, f"patched tensors differ from the new version: {wrong[:5]}"


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.9])
def test_delta_against_dense_by_changed_fraction(benchmark, fraction):
    """Where delta stops paying: bytes and time of extract+encode+decode+apply against a dense copy.
    The table of these rows is the measurement behind DEFAULT_MAX_SPARSE_FRACTION."""
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(8 << 20, generator=gen).to(torch.bfloat16)
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=gen)[: int(fraction * old.numel())]
    new[idx] = (new[idx].float() + 1).to(torch.bfloat16)

    def roundtrip():
        i = codec.changed_indices(old, new)
        enc = codec.encode_indices(i, old.numel())
        vals = codec.gather_values(new, i)
        return codec.apply_patch(old, codec.decode_indices(enc, old.numel()), vals), enc, vals

    out, enc, vals = benchmark(roundtrip)
    t0 = time.perf_counter()
    for _ in range(5):
        new.clone()
    dense_s = (time.perf_counter() - t0) / 5
    moved = enc.data.numel() + vals.numel()
    benchmark.extra_info.update(
        fraction=fraction,
        bytes_ratio=round(moved / (2 * old.numel()), 4),
        time_ratio_vs_dense_copy=round(benchmark.stats["median"] / dense_s, 2),
        encoding=enc.encoding,
    )
    assert torch.equal(codec.int_view(out), codec.int_view(new)), f"roundtrip at {fraction:.1%} is not exact"
