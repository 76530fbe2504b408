"""Invariant 1 across the data plane's own units: payloads that span many buckets (shards, segments),
tensors larger than a bucket, tensors within bytes of a bucket's size, and a last bucket left partial, at
bucket sizes the test chooses (deploy(bucket_bytes=...): tiny, unaligned, one page). A second version over
the same plan checks that nothing reused between syncs (pack buffers, segments) carries stale bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.payloads import bucket_crossing_sets
from harness.api import spec_of
from harness.manifest import Manifest
from suites.conformance.helpers import push_and_check, rerun_hint

pytestmark = [pytest.mark.requires("arbitrary_tensors"), pytest.mark.single_receiver]

BUCKET_SIZES = [64, 1000, 4096]  # tiny; not a multiple of any alignment; one page


def _flip_bits(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The next version: one bit flipped in every tensor, at a drawn position (often its tail)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        raw = t.clone().view(-1).view(torch.uint8)
        raw[int(torch.randint(0, raw.numel(), (1,), generator=gen))] ^= 1 << int(
            torch.randint(0, 8, (1,), generator=gen)
        )
        raw[-1] ^= 0x80  # the last byte: where a bucket cut short ends
        out[name] = raw.view(t.dtype).view(t.shape)
    return out


@pytest.mark.not_quick  # 2.1 s
@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
@settings(
    max_examples=max(1, settings().max_examples // 5),
    suppress_health_check=[
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)  # 3+ buckets by design; a fifth of the profile's examples (each reloads engines)
@given(data=st.data())
def test_payload_spanning_many_buckets_arrives_bitwise(
    weightsync_deployment_with_buckets,
    weightsync_backend,
    weightsync_capabilities,
    bucket_bytes,
    data,
    request,
    weightsync_example_counter,
):
    weightsync_example_counter()
    weights = data.draw(bucket_crossing_sets(bucket_bytes, weightsync_capabilities.dtypes), label="weights")
    plan = Manifest.build(1, weights, bucket_bytes)  # the reference plan: what the payload was drawn to do
    assert len(plan.bucket_sizes) >= 3, f"the payload must span buckets: {plan.bucket_sizes}"
    assert max(plan.bucket_sizes) > bucket_bytes, "one tensor at least is larger than a bucket"
    dep = weightsync_deployment_with_buckets(bucket_bytes)
    dep.reset(spec_of(weights))
    context = f"{weightsync_backend.name} with {bucket_bytes}-byte buckets ({len(plan.bucket_sizes)} buckets, {len(weights)} tensors)"
    push_and_check(dep, 1, weights, context, rerun_hint(request))
    push_and_check(
        dep,
        2,
        _flip_bits(weights, data.draw(st.integers(0, 2**31 - 1), label="flip seed")),
        f"{context}, second version",
        rerun_hint(request),
    )
