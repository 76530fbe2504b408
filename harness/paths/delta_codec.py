"""Sparse patches between two versions of a tensor, by raw bits.

Changed elements are found on integer views, so a NaN whose payload changed, or 0.0 -> -0.0, counts
as a change, and equal bit patterns never do. A patch is (flat indices, values) in checkpoint
coordinates, as vLLM's sparse transfer ships them; indices are stored as a bitmap or as gaps of the
narrowest unsigned width that fits, whichever is smaller.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from harness.api import ManifestMismatch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GAP_WIDTHS = ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64))


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of a tensor's elements (same width), for bitwise comparison and scatter."""
    flat = t.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(_INT_VIEW[t.element_size()])


def changed_indices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices of elements whose raw bits differ."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ManifestMismatch(f"cannot diff {tuple(old.shape)} {old.dtype} against {tuple(new.shape)} {new.dtype}")
    return (int_view(old) != int_view(new)).nonzero().reshape(-1)


@dataclasses.dataclass(frozen=True)
class EncodedIndices:
    encoding: str  # "bitmap" | "gap1" | "gap2" | "gap4" | "gap8"
    data: torch.Tensor  # uint8
    count: int


def encode_indices(idx: torch.Tensor, numel: int) -> EncodedIndices:
    """The smaller of a bitmap of `numel` bits and the gap list of the narrowest width."""
    count = int(idx.numel())
    bitmap_bytes = (numel + 7) // 8
    gaps = np.diff(idx.numpy(), prepend=-1) - 1 if count else np.zeros(0, dtype=np.int64)
    largest = int(gaps.max()) if count else 0
    width, np_type = next((w, t) for w, t in _GAP_WIDTHS if largest < 1 << (8 * w))
    if count * width <= bitmap_bytes:
        raw = gaps.astype(np_type).tobytes()
        return EncodedIndices(f"gap{width}", _bytes_tensor(raw), count)
    mask = np.zeros(numel, dtype=bool)
    mask[idx.numpy()] = True
    return EncodedIndices("bitmap", _bytes_tensor(np.packbits(mask).tobytes()), count)


def decode_indices(enc: EncodedIndices, numel: int) -> torch.Tensor:
    raw = enc.data.numpy().tobytes()
    if enc.encoding == "bitmap":
        if len(raw) != (numel + 7) // 8:
            raise ManifestMismatch(f"bitmap of {len(raw)} bytes for {numel} elements")
        idx = np.flatnonzero(np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=numel))
    elif enc.encoding.startswith("gap"):
        width = int(enc.encoding[3:])
        np_type = dict(_GAP_WIDTHS).get(width)
        if np_type is None or len(raw) != enc.count * width:
            raise ManifestMismatch(f"{enc.encoding} indices: {len(raw)} bytes for {enc.count} entries")
        idx = np.cumsum(np.frombuffer(raw, dtype=np_type).astype(np.int64) + 1) - 1
    else:
        raise ManifestMismatch(f"unknown index encoding {enc.encoding!r}")
    if len(idx) != enc.count or (len(idx) and (idx[-1] >= numel or idx[0] < 0)):
        raise ManifestMismatch(f"patch indices out of range: {len(idx)} indices for {numel} elements")
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))


def gather_values(new: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The changed elements' raw bytes, in index order."""
    return int_view(new)[idx].contiguous().view(torch.uint8)


def apply_patch(base: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A copy of `base` with the patch scattered in by raw bits."""
    out = base.detach().clone(memory_format=torch.contiguous_format)
    width = out.element_size()
    if values.numel() != idx.numel() * width:
        raise ManifestMismatch(f"patch has {values.numel()} value bytes for {idx.numel()} indices of width {width}")
    if idx.numel():
        int_view(out)[idx] = values.view(_INT_VIEW[width])
    return out


def _bytes_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
