"""Invariant 1: after finish_weight_update(v) every engine holds version v bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fixtures.payloads import special_values, weight_sets
from harness.api import ALL_DTYPES, spec_of
from harness.manifest import dtype_name
from suites.conformance.helpers import push_and_check, rerun_hint

pytestmark = pytest.mark.requires("arbitrary_tensors")


@given(data=st.data())
def test_full_update_is_bitwise_for_any_dtype_and_shape(
    weightsync_deployment,
    weightsync_backend,
    weightsync_capabilities,
    data,
    request,
    weightsync_example_counter,
):
    """Random bit patterns (NaN payloads, -0.0, inf), 0-d, empty, odd and non-contiguous tensors."""
    weightsync_example_counter()
    weights = data.draw(weight_sets(dtypes=weightsync_capabilities.dtypes), label="weights")
    weightsync_deployment.reset(spec_of(weights))
    push_and_check(
        weightsync_deployment, 1, weights, f"{weightsync_backend.name} full update", rerun_hint(request)
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_name)
def test_special_values_survive(
    weightsync_deployment, weightsync_backend, weightsync_capabilities, dtype, request
):
    """NaNs with distinct payloads, both zeros and both infinities arrive with the same bits."""
    if dtype not in weightsync_capabilities.dtypes:
        pytest.skip(
            f"NOT_SUPPORTED: backend {weightsync_backend.name!r} (with this engine) does not claim {dtype}"
        )
    weights = {"special.weight": special_values(dtype), "special.strided": special_values(dtype)[::2]}
    weightsync_deployment.reset(spec_of(weights))
    push_and_check(
        weightsync_deployment,
        7,
        weights,
        f"{weightsync_backend.name} special values {dtype_name(dtype)}",
        rerun_hint(request),
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_name)
def test_scalar_and_empty_tensors_arrive(
    weightsync_deployment, weightsync_backend, weightsync_capabilities, dtype, request
):
    """0-d tensors (fp8 weight scales, a norm's scalar) and empty ones, beside an ordinary tensor: the property
    test above draws them too, at random; this one makes sure every dtype meets them in every run."""
    if dtype not in weightsync_capabilities.dtypes:
        pytest.skip(
            f"NOT_SUPPORTED: backend {weightsync_backend.name!r} (with this engine) does not claim {dtype}"
        )
    weights = {
        "layer.weight_scale": torch.tensor(0.375).to(dtype),
        "layer.empty": torch.empty(0, 4, dtype=dtype),
        "layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype),
    }
    weightsync_deployment.reset(spec_of(weights))
    push_and_check(
        weightsync_deployment,
        1,
        weights,
        f"{weightsync_backend.name} scalar and empty {dtype_name(dtype)}",
        rerun_hint(request),
    )


@given(sizes=st.lists(st.integers(0, 5000), min_size=2, max_size=12))
def test_many_tensors_across_buckets(
    weightsync_deployment, weightsync_backend, sizes, request, weightsync_example_counter
):
    """Tensor counts and sizes that straddle bucket and shard boundaries arrive intact."""
    weightsync_example_counter()
    gen = torch.Generator().manual_seed(len(sizes))
    weights = {f"layer.{i}.w": torch.randn(n, generator=gen).to(torch.bfloat16) for i, n in enumerate(sizes)}
    weightsync_deployment.reset(spec_of(weights))
    push_and_check(
        weightsync_deployment, 3, weights, f"{weightsync_backend.name} bucketed update", rerun_hint(request)
    )
