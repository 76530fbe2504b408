"""Inside vLLM's worker: the harness's CPU weight transport and the oracle's read-back.

vLLM imports this module in every worker when it is named by `worker_extension_cls` (the
EXTENSION path below); importing it registers BACKEND in vLLM's WeightTransferEngineFactory, so
`weight_transfer_config={"backend": BACKEND}` drives vLLM's own lifecycle with it:

    init_weight_transfer_engine({"root": DIR})   checkpoints may be read from under DIR (each init
                                                 adds a root: several trainers may sync one engine)
    start_weight_update()                        a fresh, empty staging area; the model is untouched
    update_weights({"path": CKPT, "manifest": M})  read a harness disk checkpoint (safetensors shards
                                                 + manifest), verify it, stage it; model untouched
    finish_weight_update()                       apply everything staged in one layerwise reload

Tensors travel as safetensors files, never pickle. Every check runs before the model is touched, so
a refused update leaves the served weights as they were, bit for bit: the announced manifest must be
the one on disk, every digest must match, every name and shape must be one the checkpoint has, and a
fused group (q/k/v, gate/up) must arrive whole within one update_weights call (vLLM's layerwise
reload fills the missing rows of a partial group with uninitialised memory). After the reload, a
layer tied to a loaded Parameter (a tied LM head) gets its packed CPU kernel rebuilt, which vLLM's
reload does not do.

Errors are ValueErrors whose message starts with the harness error class name
("UnknownTensorError: ..."), so the harness can re-raise the right type from either form (in-process
or over HTTP, where only the message survives).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from harness.api import ManifestMismatch, WeightSyncError
from harness.engines.vllm_constants import BACKEND, EXTENSION  # noqa: F401 - EXTENSION: this module's own path
from harness.engines.vllm_layout import FusedLayout, checkpoint_spec
from harness.manifest import Manifest, dtype_name
from harness.paths.disk import MANIFEST_FILE, read_checkpoint


class RefusedUpdate(ValueError):
    """An update the transport will not apply; the message names the harness error class."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")


@dataclasses.dataclass
class FilesInitInfo(WeightTransferInitInfo):
    root: str = ""


@dataclasses.dataclass
class FilesUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""
    manifest: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Reproduction hook only: skip the transport's fused-group guard and its tied-head repack, and
    # hand the verified tensors to vLLM's layerwise reload as they are, to show what vLLM itself does.
    # Never set by the harness's Receiver.
    raw_vllm_reload: bool = False


def model_layout(model: torch.nn.Module, model_config: Any) -> FusedLayout:
    """The fusion rules of the served model, against the checkpoint it was loaded from."""
    spec = checkpoint_spec(model_config.model, model_config.dtype)
    return FusedLayout(getattr(model, "packed_modules_mapping", {}) or {}, spec)


class FilesWeightTransferEngine(WeightTransferEngine[FilesInitInfo, FilesUpdateInfo]):
    """Stage-verify-apply transport over harness disk checkpoints (see the module docstring)."""

    init_info_cls = FilesInitInfo
    update_info_cls = FilesUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._roots: set[Path] = set()
        self._staged: dict[str, torch.Tensor] = {}
        self._layout: FusedLayout | None = None
        self._raw = False

    @property
    def layout(self) -> FusedLayout:
        if self._layout is None:
            self._layout = model_layout(self.model, self.model_config)
        return self._layout

    @property
    def staged_count(self) -> int:
        return len(self._staged)

    def discard(self) -> int:
        n, self._staged, self._raw = len(self._staged), {}, False
        return n

    # ------------------------------------------------------------------ vLLM lifecycle
    def init_transfer_engine(self, init_info: FilesInitInfo) -> None:
        root = Path(init_info.root or "")
        if not init_info.root or not root.is_absolute():
            raise RefusedUpdate(
                "LifecycleError", f"init_info 'root' must be an absolute directory, got {init_info.root!r}"
            )
        self._roots.add(root.resolve())

    def start_weight_update(self) -> None:
        if not self._roots:
            raise RefusedUpdate("LifecycleError", "start_weight_update before init_weight_transfer_engine")
        self._staged = {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FilesUpdateInfo) -> None:
        try:
            tensors = self._read_verified(update_info)
        except BaseException:
            self._staged = {}  # vLLM ends the session on an error; nothing of it may be applied later
            raise
        self._staged.update(tensors)
        self._raw = self._raw or update_info.raw_vllm_reload

    def finish_weight_update(self) -> None:
        staged, self._staged = self._staged, {}
        raw, self._raw = self._raw, False
        if not staged:
            return  # an empty or discarded update leaves the model exactly as it is
        # Imported here: the reload module pulls in model-loader machinery the factory does not need.
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        self.model.load_weights(list(staged.items()))
        finalize_layerwise_reload(self.model, self.model_config)
        if not raw:
            repack_tied_kernels(self.model, {self.layout.live_name(n) for n in staged})

    def shutdown(self) -> None:
        self._staged = {}
        self._roots.clear()

    # ------------------------------------------------------------------ checks
    def _read_verified(self, info: FilesUpdateInfo) -> dict[str, torch.Tensor]:
        try:
            manifest = Manifest.from_json(info.manifest)
        except ManifestMismatch as exc:
            raise RefusedUpdate("ManifestMismatch", str(exc)) from None
        v = manifest.version
        directory = Path(info.path).resolve()
        if not any(directory.is_relative_to(r) for r in self._roots):
            raise RefusedUpdate(
                "ManifestMismatch",
                f"version {v}: checkpoint {directory} is outside the roots {sorted(map(str, self._roots))}",
            )
        try:
            on_disk = Manifest.loads((directory / MANIFEST_FILE).read_bytes())
        except FileNotFoundError:
            raise RefusedUpdate(
                "ManifestMismatch", f"version {v}: {directory / MANIFEST_FILE} missing"
            ) from None
        if on_disk != manifest:
            raise RefusedUpdate(
                "ManifestMismatch", f"version {v}: the checkpoint at {directory} is not the one announced"
            )
        spec = self.layout.spec
        for e in manifest.entries:
            if e.name not in spec:
                raise RefusedUpdate(
                    "UnknownTensorError",
                    f"version {v}: unknown tensor {e.name!r} (the model has {len(spec)})",
                )
            s = spec[e.name]
            if e.shape != s.shape or e.dtype != dtype_name(s.dtype):
                raise RefusedUpdate(
                    "ManifestMismatch",
                    f"version {v}: tensor {e.name!r} is {e.shape} {e.dtype}, the model holds {s.shape} {dtype_name(s.dtype)}",
                )
        partial = self.layout.incomplete_groups(manifest.names)
        if partial and not info.raw_vllm_reload:
            live, missing = next(iter(partial.items()))
            sent = [n for n in manifest.names if self.layout.live_name(n) == live]
            raise RefusedUpdate(
                "ManifestMismatch",
                f"version {v}: {sent} sent without {missing}, which vLLM fuses with them into {live!r}"
                f"{f' (and {len(partial) - 1} more partial groups)' if len(partial) > 1 else ''}; "
                "send every part of a fused group in the same update_weights call",
            )
        twice = sorted(set(manifest.names) & set(self._staged))
        if twice:
            raise RefusedUpdate(
                "ManifestMismatch", f"version {v}: tensor(s) {twice[:5]} sent twice in one update"
            )
        try:
            tensors = read_checkpoint(directory, manifest)
            for name in manifest.names:
                if name not in tensors:
                    raise RefusedUpdate(
                        "ManifestMismatch", f"version {v}: tensor {name!r} is missing from the shards"
                    )
                manifest.verify(name, tensors[name])
        except RefusedUpdate:
            raise
        except WeightSyncError as exc:  # digests that do not match, unreadable shards
            raise RefusedUpdate(type(exc).__name__, str(exc)) from None
        # Detach from the files: the sender may delete old checkpoints before finish applies these.
        return {n: t.clone() for n, t in tensors.items()}


def repack_tied_kernels(model: torch.nn.Module, loaded: set[str]) -> list[str]:
    """Rebuild the CPU GEMM kernel of every layer that shares a loaded Parameter under another name.

    A tied LM head shares the embedding's Parameter, but on CPU it computes through its own packed
    oneDNN copy of it. vLLM's layerwise reload only re-processes the layer the name was loaded into
    (the embedding), so the head would keep computing with the old embedding (see
    suites/vllm/test_vllm_findings.py). Returns the names of the layers repacked."""
    names_by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(p), []).append(name)
    repacked = []
    for names in names_by_param.values():
        if len(names) < 2 or not loaded.intersection(names):
            continue
        for name in names:
            module = model.get_submodule(name.rpartition(".")[0])
            if name not in loaded and hasattr(module, "cpu_linear") and hasattr(module, "quant_method"):
                module.quant_method.process_weights_after_loading(module)
                repacked.append(name)
    return repacked


try:
    WeightTransferEngineFactory.register_engine(BACKEND, FilesWeightTransferEngine)
except ValueError:  # imported twice in one process (in-process form: the harness and the worker)
    pass


# ---------------------------------------------------------------------------------------- read-back
def _kernel_weight(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """W as the module's CPU GEMM kernel computes with it: I @ W^T through the kernel, transposed.

    Exact for finite values (each output is one product by 1 plus exact zeros); -0.0 reads back as
    +0.0 and a NaN spreads along its row, so payloads for this oracle must be finite and nonzero."""
    k = getattr(module, "input_size_per_partition", None) or module.weight.shape[1]
    eye = torch.eye(k, dtype=dtype)
    return module.cpu_linear(eye, module.weight, None).t().contiguous()


@torch.inference_mode()
def live_tensors(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor the forward pass reads, by vLLM name, copied out.

    Parameters are read as they are; a layer that computes through a packed CPU kernel (linear
    layers, the LM head) is read through that kernel, since its `weight` Parameter may be empty or
    stale. An input embedding is read from its Parameter (lookups use it); when the LM head is tied
    to it, "lm_head.weight" is the head's kernel, so a stale head shows up as a mismatch."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    out = {n: p.detach().clone() for n, p in model.named_parameters() if p.numel() > 0}
    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        if isinstance(module, LinearBase | ParallelLMHead):
            out[f"{name}.weight"] = _kernel_weight(module, dtype)
    return out


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker; its methods are callable through collective_rpc (and the server's
    /collective_rpc). Arguments and results are JSON-able; tensors go through files."""

    def _weightsync_layout(self) -> FusedLayout:
        # The transport's copy, read once: model_config.model moves if anyone reloads from a path.
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, FilesWeightTransferEngine):
            return engine.layout
        return model_layout(self.model_runner.model, self.model_config)

    def weightsync_spec(self) -> dict[str, Any]:
        """The checkpoint spec updates are checked against, and the fusion rules."""
        layout = self._weightsync_layout()
        return {
            "spec": {
                n: {"shape": list(s.shape), "dtype": dtype_name(s.dtype)} for n, s in layout.spec.items()
            },
            "packed": {k: list(v) for k, v in layout.packed.items()},
            "dtype": dtype_name(self.model_config.dtype),
            "pid": os.getpid(),
        }

    def weightsync_read(self, path: str, layout: str = "checkpoint") -> dict[str, Any]:
        """Write the live weights to the safetensors file `path`: by checkpoint name (fused tensors
        sliced back into their parts) or, with layout="live", by vLLM name. One worker's whole model:
        refused under tensor parallelism, where every rank would write its shards to the one path
        (weightsync_read_shard reads each rank's)."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        tp = get_tensor_model_parallel_world_size()
        if tp > 1:
            raise ValueError(
                f"weightsync_read reads one whole model; this engine runs TP={tp}: use weightsync_read_shard"
            )
        model = self.model_runner.model
        live = live_tensors(model, self.model_config.dtype)
        if layout == "live":
            tensors = live
        elif layout == "checkpoint":
            tensors = self._weightsync_layout().to_checkpoint(live)
        else:
            raise ValueError(f"layout must be 'checkpoint' or 'live', got {layout!r}")
        tmp = f"{path}.tmp-{os.getpid()}"
        safetensors.torch.save_file({n: t.contiguous() for n, t in tensors.items()}, tmp)
        os.replace(tmp, path)
        return {"path": path, "tensors": len(tensors)}

    def weightsync_read_shard(self, directory: str) -> dict[str, Any]:
        """Write this worker's live tensor-parallel shards, by vLLM name, to `directory`/tp<rank>.safetensors
        (every TP rank writes its own file; read through the packed kernels as weightsync_read does)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        path = os.path.join(directory, f"tp{rank}.safetensors")
        live = live_tensors(self.model_runner.model, self.model_config.dtype)
        tmp = f"{path}.tmp-{os.getpid()}"
        safetensors.torch.save_file({n: t.contiguous() for n, t in live.items()}, tmp)
        os.replace(tmp, path)
        return {"rank": rank, "path": path, "tensors": len(live)}

    def weightsync_discard(self) -> dict[str, Any]:
        """Drop whatever the transport staged; report whether vLLM still holds an update open (then
        a finish_weight_update, with nothing staged, closes it without touching the model)."""
        engine = getattr(self, "weight_transfer_engine", None)
        dropped = engine.discard() if isinstance(engine, FilesWeightTransferEngine) else 0
        return {"dropped": dropped, "active": bool(getattr(self, "_weight_update_active", False))}
