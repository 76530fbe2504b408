"""Encoding of control messages between processes: JSON for metadata, safetensors for tensors.

Never pickle: a rank or a server only ever parses JSON and safetensors bytes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

from harness.api import GenerationRequest, TensorSpec, TokenEvent, WeightSpec
from harness.manifest import dtype_from_name, dtype_name


def spec_to_json(spec: WeightSpec | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {n: {"shape": list(s.shape), "dtype": dtype_name(s.dtype)} for n, s in spec.items()}


def spec_from_json(data: Mapping[str, Any] | None) -> dict[str, TensorSpec] | None:
    if data is None:
        return None
    return {
        n: TensorSpec(tuple(int(d) for d in s["shape"]), dtype_from_name(s["dtype"])) for n, s in data.items()
    }


def request_to_json(r: GenerationRequest) -> dict[str, Any]:
    return dataclasses.asdict(r)


def request_from_json(d: Mapping[str, Any]) -> GenerationRequest:
    return GenerationRequest(
        request_id=str(d["request_id"]),
        prompt_token_ids=tuple(int(t) for t in d["prompt_token_ids"]),
        max_tokens=int(d["max_tokens"]),
        stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())),
        logprobs=None if d.get("logprobs") is None else int(d["logprobs"]),
    )


def event_to_json(e: TokenEvent) -> dict[str, Any]:
    return dataclasses.asdict(e)


def event_from_json(d: Mapping[str, Any]) -> TokenEvent:
    d = dict(d)
    if d.get("top_logprobs") is not None:  # JSON lists back to the event's (id, logprob) pairs
        d["top_logprobs"] = tuple((int(t), float(lp)) for t, lp in d["top_logprobs"])
    return TokenEvent(**d)


def tensors_to_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    # safetensors wants contiguous, unshared host storage (a device tensor crosses to the host here)
    return safetensors.torch.save({n: t.detach().contiguous().cpu().clone() for n, t in tensors.items()})


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(data)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def loads(data: bytes) -> Any:
    return json.loads(data)
