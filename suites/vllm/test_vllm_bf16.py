"""vLLM serving in bfloat16, the dtype RL rollouts run in.

Updates land bit for bit through the packed bf16 kernels (the oracle reads them back), consecutive
trainer versions land exactly while only ~1% of bf16 entries change per step (the premise of the
delta path), and a trainer that sends its float32 master weights is refused, naming the tensor and
both dtypes, with the served weights kept.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from harness.api import ManifestMismatch
from harness.deployment import push
from harness.manifest import dtype_name
from harness.trainer import ReferenceTrainer, changed_fraction

from .helpers import (
    assert_serves,
    assert_unchanged,
    engine_of,
    fresh_weights,
    next_version,
    push_new_version,
    rerun,
    snapshot,
)

pytestmark = pytest.mark.vllm


def test_bf16_engine_holds_bf16_weights(bf16_llama):
    spec = engine_of(bf16_llama).weight_spec()
    dtypes = {str(s.dtype) for s in spec.values()}
    assert dtypes == {"torch.bfloat16"}, f"the bf16 engine reports checkpoint dtypes {sorted(dtypes)}"


def test_bf16_update_is_bitwise_exact(bf16_llama, request):
    version, weights = push_new_version(bf16_llama)
    assert_serves(bf16_llama, version, weights, "bf16 update", rerun(request))


def test_bf16_trainer_versions_land_exactly(bf16_llama, request):
    engine = engine_of(bf16_llama)
    trainer = ReferenceTrainer(engine.weight_spec(), seed=31)
    trainer.version = engine.weight_version  # the session engine only moves forward
    previous = None
    for _ in range(4):
        version, weights = trainer.step()
        push(bf16_llama, version, weights)
        assert_serves(bf16_llama, version, weights, f"bf16 trainer step {version}", rerun(request))
        if previous is not None:
            changed = changed_fraction(previous, weights)
            assert 0 < changed < 0.05, (
                f"a trainer step changed {changed:.2%} of bf16 entries; RL steps change ~1% (delta's premise)"
            )
        previous = weights


def test_float32_master_weights_are_refused_and_bf16_kept(bf16_llama, request):
    before = snapshot(bf16_llama)
    weights = {n: t.float() for n, t in fresh_weights(bf16_llama).items()}
    with pytest.raises(ManifestMismatch) as info:
        push(bf16_llama, next_version(bf16_llama), weights)
    message = str(info.value)
    sent, held = dtype_name(torch.float32), dtype_name(torch.bfloat16)
    assert sent in message and held in message, (
        f"the refusal does not name both dtypes ({sent}, {held}): {message}"
    )
    assert_unchanged(bf16_llama, before, "after float32 weights were refused", rerun(request))
    assert all(t.dtype == torch.bfloat16 for t in before[1].values())
