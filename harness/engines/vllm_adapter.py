"""What both vLLM forms share (`VllmEngine`): the spec, the oracle, versions, commits through the
transport, and vLLM's errors mapped back to harness errors. The forms are harness.engines.vllm
(in process) and harness.engines.vllm_server (the dev-mode server over HTTP).

The oracle (`read_weights`) reads what the model computes with, through the packed CPU kernels, by
checkpoint name; `read_live` gives the same by vLLM's fused names (plus a tied LM head).
"""

from __future__ import annotations

import abc
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from harness.api import (
    JSON,
    BackendError,
    Engine,
    EngineStateError,
    LifecycleError,
    TensorSpec,
    TransferError,
    WeightSpec,
    WeightSyncError,
)
from harness.engines.vllm_constants import INITIAL_VERSION, LIFECYCLE_MESSAGES
from harness.engines.vllm_layout import FusedLayout
from harness.engines.vllm_receiver import VllmReceiver
from harness.error_codec import from_message
from harness.manifest import dtype_from_name
from harness.paths.disk import DiskSender


def harness_error(message: str, context: str) -> WeightSyncError:
    """The harness error a vLLM-side failure stands for: vLLM's own lifecycle-order messages are
    LifecycleErrors; the transport prefixes its messages with the error class name, which survives both
    in-process exceptions and HTTP error bodies (harness.error_codec.from_message)."""
    for pattern in LIFECYCLE_MESSAGES:
        if pattern in message:
            return LifecycleError(f"{context}: vLLM says: {pattern}")
    named = from_message(message)
    if named:
        cls, detail = named
        return cls(f"{context}: {detail}")
    return TransferError(f"{context}: vLLM failed: {message.strip()[-1500:]}")


def parse_version(raw: str) -> int:
    """vLLM's opaque version string -> the harness's int (the harness only ever sets decimal ones)."""
    if raw in (INITIAL_VERSION, "", None):
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise EngineStateError(
            f"vLLM reports weight version {raw!r}, which the harness did not set"
        ) from None


class VllmEngine(Engine, abc.ABC):
    """What both forms share: the spec, the oracle, versions, and commits through the transport.

    The control plane (the four lifecycle calls, collective_rpc, the prefix cache, pause) is per form.
    Errors from vLLM come back as harness errors (UnknownTensorError, ManifestMismatch, ...)."""

    form: str = "?"
    owns_workdir = False  # remove the workdir at shutdown (engines made by make_engine)
    max_num_seqs: int | None = None  # set by each form from its launch settings

    def __init__(self, model_dir: str | os.PathLike, workdir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spec: dict[str, TensorSpec] | None = None
        self._layout: FusedLayout | None = None
        self._reads = itertools.count()
        self._commit_sender: DiskSender | None = None

    @property
    def max_running_requests(self) -> int | None:
        return self.max_num_seqs

    def model_config(self) -> JSON:
        with open(self.model_dir / "config.json") as f:
            return json.load(f)

    # ------------------------------------------------------------------ control plane (per form)
    @abc.abstractmethod
    def init_weight_transfer_engine(self, init_info: JSON) -> None: ...

    @abc.abstractmethod
    def start_weight_update(self) -> None: ...

    @abc.abstractmethod
    def update_weights(self, update_info: JSON) -> None: ...

    @abc.abstractmethod
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    @abc.abstractmethod
    def collective_rpc(self, method: str, kwargs: JSON | None = None) -> list[Any]: ...

    @abc.abstractmethod
    def vllm_weight_version(self) -> str:
        """The version string vLLM reports (/weight_info on the server)."""

    # ------------------------------------------------------------------ Engine: state
    @property
    def weight_version(self) -> int:
        return parse_version(self.vllm_weight_version())

    def _worker_spec(self) -> JSON:
        results = self.collective_rpc("weightsync_spec")
        if not results:
            raise EngineStateError(f"{self.form} vLLM: weightsync_spec returned nothing")
        return results[0]

    def weight_spec(self) -> dict[str, TensorSpec]:
        """Checkpoint (HF) names, as the worker's transport checks them."""
        if self._spec is None:
            raw = self._worker_spec()
            self._spec = {
                n: TensorSpec(tuple(s["shape"]), dtype_from_name(s["dtype"])) for n, s in raw["spec"].items()
            }
            self._layout = FusedLayout(raw["packed"], self._spec)
        return dict(self._spec)

    @property
    def layout(self) -> FusedLayout:
        """How checkpoint names fuse into vLLM's live parameters for this model."""
        if self._layout is None:
            self.weight_spec()
        assert self._layout is not None
        return self._layout

    def _read(self, layout: str) -> dict[str, torch.Tensor]:
        path = self.workdir / "readback" / f"{os.getpid()}-{next(self._reads)}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.collective_rpc("weightsync_read", {"path": str(path), "layout": layout})
            return safetensors.torch.load_file(str(path))
        finally:
            path.unlink(missing_ok=True)

    def read_weights(self) -> dict[str, torch.Tensor]:
        """Oracle: what the forward pass computes with, by checkpoint name (fused tensors sliced).
        Read through each packed CPU kernel (identity matmul): exact for finite values."""
        return self._read("checkpoint")

    def read_live(self) -> dict[str, torch.Tensor]:
        """The same by vLLM name (qkv_proj, gate_up_proj, and lm_head.weight even when tied)."""
        return self._read("live")

    def read_shards(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each tensor-parallel rank's live shards, by vLLM name: {TP rank: {name: tensor}} (one entry
        without TP). Read through the packed kernels, exact for finite values."""
        directory = self.workdir / "readback" / f"shards-{os.getpid()}-{next(self._reads)}"
        directory.mkdir(parents=True, exist_ok=True)
        try:
            results = self.collective_rpc("weightsync_read_shard", {"directory": str(directory)})
            return {r["rank"]: safetensors.torch.load_file(r["path"]) for r in results}
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ Engine: commit
    def commit_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Install `tensors` as `version` through the transport (a private disk checkpoint)."""
        if self._commit_sender is None:
            self._commit_sender = DiskSender(self.workdir / "commits")
        receiver = VllmReceiver(self)
        receiver.init_transfer_engine(self._commit_sender.init())
        receiver.start_weight_update()
        try:
            receiver.update_weights(self._commit_sender.prepare(version, tensors))
        except BaseException:
            receiver.abort_weight_update()
            raise
        receiver.finish_weight_update(version)

    def discard_update(self) -> None:
        """End an open vLLM update without applying anything: the transport drops what it staged,
        then, if vLLM still holds the update open, an empty finish closes it (the model is untouched
        and the version stays)."""
        results = self.collective_rpc("weightsync_discard")
        if any(r.get("active") for r in results):
            self.finish_weight_update(None)

    def describe(self) -> str:
        return f"vLLM ({self.form}) serving {self.model_dir.name}"


def tiny_model_dir() -> Path:
    """The tiny Llama the `vllm` engine factories serve (harness.engines.tiny_hf_models), built once under
    WEIGHTSYNC_MODEL_CACHE (default a folder in the temp dir)."""
    from harness.engines.tiny_hf_models import TINY_LLAMA, build

    cache = os.environ.get("WEIGHTSYNC_MODEL_CACHE") or os.path.join(
        tempfile.gettempdir(), "weightsync-models"
    )
    return build(TINY_LLAMA, cache)


def refuse_foreign_spec(engine: VllmEngine, spec: WeightSpec | None) -> VllmEngine:
    """`engine`, once `spec` is known to be a subset of the fixed model it serves; else shut it down and refuse."""
    if spec is not None:
        own = engine.weight_spec()
        foreign = sorted(n for n, s in spec.items() if own.get(n) != s)
        if foreign:
            engine.shutdown()
            raise BackendError(
                f"vLLM serves a fixed model; it cannot hold {foreign[:5]} "
                f"({len(foreign)} tensor(s) not in its checkpoint spec with that shape and dtype)"
            )
    return engine
