"""Sparse patches between two versions of a tensor, by raw bits.

Changed elements are found on integer views, so a NaN whose payload changed, or 0.0 -> -0.0, counts
as a change, and equal bit patterns never do. A patch is (flat indices, values) in checkpoint
coordinates, as vLLM's sparse transfer ships them; indices are stored as a bitmap or as gaps of the
narrowest unsigned width that fits, whichever is smaller.
"""

from __future__ import annotations

import dataclasses

import torch

from harness.api import ManifestMismatch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of a tensor's elements (same width), for bitwise comparison and scatter."""
    flat = t.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(_INT_VIEW[t.element_size()])


def changed_indices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices of elements whose raw bits differ."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ManifestMismatch(
            f"cannot diff {tuple(old.shape)} {old.dtype} against {tuple(new.shape)} {new.dtype}"
        )
    old_bits, new_bits = int_view(old).reshape(-1), int_view(new).reshape(-1)
    width = old.element_size()
    per_word = 8 // width
    if per_word > 1 and old.numel() % per_word == 0 and old.device.type == "cpu":
        try:  # compare 8-byte words: nonzero() runs over a quarter (bf16) of the elements
            old_words, new_words = old_bits.view(torch.int64), new_bits.view(torch.int64)
        except RuntimeError:  # not 8-byte aligned
            old_words = None
        if old_words is not None:
            words = (old_words != new_words).nonzero().reshape(-1)
            if words.numel() * per_word <= old.numel() // 4:
                # which elements of each changed word differ: the changed words seen as elements again
                # (memory order, so no endianness), compared lane by lane
                lanes = (
                    (
                        old_words.index_select(0, words).view(old_bits.dtype)
                        != new_words.index_select(0, words).view(old_bits.dtype)
                    )
                    .nonzero()
                    .reshape(-1)
                )
                return words[lanes // per_word] * per_word + lanes % per_word
    return (old_bits != new_bits).nonzero().reshape(-1)


@dataclasses.dataclass(frozen=True)
class EncodedIndices:
    encoding: str  # "bitmap" | "gap1" | "gap2" | "gap4" | "gap8"
    data: torch.Tensor  # uint8, on the device the indices were on
    count: int


_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # np.packbits order: first element in the high bit


def encode_indices(idx: torch.Tensor, numel: int) -> EncodedIndices:
    """The smaller of a bitmap of `numel` bits and the gap list of the narrowest width (torch ops
    only, so it runs where the tensors live, CPU or GPU)."""
    count = int(idx.numel())
    bitmap_bytes = (numel + 7) // 8
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1 if count else idx.new_zeros(0)
    largest = int(gaps.max()) if count else 0
    width = next(w for w in (1, 2, 4) if largest < 1 << (8 * w)) if largest < 1 << 32 else 8
    if count * width <= bitmap_bytes:
        # little-endian low `width` bytes of each int64 gap
        data = gaps.to(torch.int64).contiguous().view(torch.uint8).reshape(-1, 8)[:, :width].reshape(-1)
        return EncodedIndices(f"gap{width}", data.contiguous(), count)
    mask = torch.zeros(bitmap_bytes * 8, dtype=torch.uint8, device=idx.device)
    mask[idx] = 1
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=idx.device)
    return EncodedIndices("bitmap", (mask.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.uint8), count)


def decode_indices(enc: EncodedIndices, numel: int) -> torch.Tensor:
    raw = enc.data
    if enc.encoding == "bitmap":
        if raw.numel() != (numel + 7) // 8:
            raise ManifestMismatch(f"bitmap of {raw.numel()} bytes for {numel} elements")
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=raw.device)
        bits = (raw.reshape(-1, 1) & weights) != 0
        idx = bits.reshape(-1)[:numel].nonzero().reshape(-1)
    elif enc.encoding in ("gap1", "gap2", "gap4", "gap8"):
        width = int(enc.encoding[3:])
        if raw.numel() != enc.count * width:
            raise ManifestMismatch(f"{enc.encoding} indices: {raw.numel()} bytes for {enc.count} entries")
        wide = torch.zeros(enc.count, 8, dtype=torch.uint8, device=raw.device)
        wide[:, :width] = raw.reshape(-1, width)
        idx = torch.cumsum(wide.view(torch.int64).reshape(-1) + 1, dim=0) - 1
    else:
        raise ManifestMismatch(f"unknown index encoding {enc.encoding!r}")
    if idx.numel() != enc.count or (idx.numel() and (int(idx[-1]) >= numel or int(idx[0]) < 0)):
        raise ManifestMismatch(f"patch indices out of range: {idx.numel()} indices for {numel} elements")
    return idx


def gather_values(new: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The changed elements' raw bytes, in index order."""
    return int_view(new)[idx].contiguous().view(torch.uint8)


def apply_patch(
    base: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    """A copy of `base` with the patch scattered in by raw bits (`in_place`: into `base` itself, when it
    is the caller's own contiguous copy)."""
    if in_place and base.is_contiguous():
        out = base.detach()
    else:
        out = base.detach().clone(memory_format=torch.contiguous_format)
    width = out.element_size()
    if values.numel() != idx.numel() * width:
        raise ManifestMismatch(
            f"patch has {values.numel()} value bytes for {idx.numel()} indices of width {width}"
        )
    if idx.numel():
        int_view(out)[idx] = values.view(_INT_VIEW[width])
    return out
