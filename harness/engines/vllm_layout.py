"""Checkpoint names versus vLLM's live layout, without importing vLLM.

A trainer holds Hugging Face names (q_proj, k_proj, v_proj, gate_proj, up_proj); vLLM fuses some of
them into one live parameter (qkv_proj, gate_up_proj), stacking the parts' rows in the order of the
model's `packed_modules_mapping`. This module maps one onto the other, so the harness can speak
checkpoint names on both sides of vLLM and still read and check the fused live tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path

import safetensors
import torch

from harness.api import TensorSpec


def checkpoint_spec(model_dir: str | Path, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Names and shapes of every tensor in the model directory's safetensors files; floating tensors
    take `dtype` (the dtype vLLM serves in, which is what an update must carry to be bit-exact)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    spec: dict[str, TensorSpec] = {}
    for f in files:
        with safetensors.safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = st.get_slice(name)
                stored = _SAFETENSORS_DTYPES.get(sl.get_dtype(), dtype)
                spec[name] = TensorSpec(tuple(sl.get_shape()), dtype if stored.is_floating_point else stored)
    return spec


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class Part:
    """Where one checkpoint tensor lives inside vLLM: `live_name`, rows [start, stop)."""

    live_name: str
    start: int
    stop: int
    group: tuple[str, ...]  # every checkpoint name fused into live_name, in row order


class FusedLayout:
    """The fusion rules of one model: `packed` is vLLM's packed_modules_mapping
    ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}), `spec` the checkpoint spec."""

    def __init__(self, packed: Mapping[str, Iterable[str]], spec: Mapping[str, TensorSpec]):
        self.packed = {fused: tuple(parts) for fused, parts in packed.items()}
        self.spec = dict(spec)
        self._parts: dict[str, Part] = {}
        for name in self.spec:
            module, _, param = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            for fused, parts in self.packed.items():
                if leaf not in parts:
                    continue
                group = tuple(f"{parent}.{p}.{param}" for p in parts)
                if any(g not in self.spec for g in group):
                    continue  # not really fused here (e.g. a model without one of the parts)
                start = 0
                for g in group:
                    rows = self.spec[g].shape[0] if self.spec[g].shape else 1
                    if g == name:
                        self._parts[name] = Part(f"{parent}.{fused}.{param}", start, start + rows, group)
                        break
                    start += rows
                break

    def part(self, name: str) -> Part | None:
        """Where a fused checkpoint tensor lives; None for a tensor vLLM keeps under its own name."""
        return self._parts.get(name)

    def live_name(self, name: str) -> str:
        p = self._parts.get(name)
        return p.live_name if p else name

    def incomplete_groups(self, names: Iterable[str]) -> dict[str, list[str]]:
        """{live name: missing checkpoint names} for every fused group `names` covers only in part."""
        names = set(names)
        out: dict[str, list[str]] = {}
        for n in sorted(names):
            p = self._parts.get(n)
            if p is None:
                continue
            missing = [g for g in p.group if g not in names]
            if missing:
                out[p.live_name] = missing
        return out

    def to_live(self, checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors -> live names, fused groups concatenated (groups must be whole)."""
        partial = self.incomplete_groups(checkpoint)
        if partial:
            raise ValueError(f"cannot fuse partial groups: {partial}")
        out: dict[str, torch.Tensor] = {}
        for name, t in checkpoint.items():
            p = self._parts.get(name)
            if p is None:
                out[name] = t
            elif name == p.group[0]:
                out[p.live_name] = torch.cat([checkpoint[g] for g in p.group], dim=0)
        return out

    def to_checkpoint(self, live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Live tensors -> every checkpoint name of the spec that `live` covers (fused ones sliced)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.spec:
            p = self._parts.get(name)
            if p is None:
                if name in live:
                    out[name] = live[name]
            elif p.live_name in live:
                out[name] = live[p.live_name][p.start : p.stop].clone()
        return out
