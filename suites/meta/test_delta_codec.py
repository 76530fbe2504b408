"""delta's change finder (harness.paths.delta_codec.changed_indices) compares 8-byte words first and
then the elements of the words that changed: it must return exactly the element-wise answer, bit for
bit, for every dtype, length, alignment and density."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.paths.delta_codec import changed_indices, int_view

DTYPES = [torch.uint8, torch.int8, torch.bfloat16, torch.float16, torch.int32, torch.float32, torch.float64]


def _element_wise(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return (int_view(old).reshape(-1) != int_view(new).reshape(-1)).nonzero().reshape(-1)


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(0, 3000),
    offset=st.integers(0, 7),
    changes=st.lists(st.tuples(st.integers(0, 2999), st.integers(0, 63)), max_size=60),
    seed=st.integers(0, 2**16),
)
def test_changed_indices_equal_the_element_wise_comparison(dtype, numel, offset, changes, seed):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, ((numel + offset) * torch.tensor([], dtype=dtype).element_size(),), generator=gen
    )
    base = raw.to(torch.uint8).view(dtype)[offset:]  # an offset breaks the 8-byte alignment of the words
    new = base.clone()
    bits = int_view(new).reshape(-1)
    width = 8 * new.element_size()
    for index, bit in changes:  # flip one bit: a sign, a NaN payload, a low mantissa bit all count
        if numel:
            k, b = index % numel, bit % width
            mask = (
                -(1 << b) if b == width - 1 and bits.dtype != torch.uint8 else 1 << b
            )  # the sign bit, signed
            bits[k : k + 1] ^= torch.tensor([mask], dtype=bits.dtype)
    got, want = changed_indices(base, new), _element_wise(base, new)
    assert torch.equal(got, want), (
        f"{dtype} numel {numel} offset {offset}: got {got.tolist()[:10]}, want {want.tolist()[:10]}"
    )
