"""One safetensors file per version: the trainer writes it, every engine reads it.

What a backend author writes, and what weightsync provides:
- `FileSender` (ours): stages a version as one file, written under a temporary name and renamed, so a
  reader sees either no file or a whole one; `Manifest.build` records names, shapes, dtypes and digests.
- `FileReceiver` (ours): loads the file. `StagingReceiver` (weightsync) owns the lifecycle rules: calls
  in order, a version newer than the committed one, names and shapes the engine knows, digests that match;
  then it commits into the engine atomically at finish.
- `RankDeployment` (weightsync) runs each receiver with its engine in a rank process it supervises
  (a hung rank is killed after the timeout, a dead one restarted by the next push).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from harness.api import (
    DEFAULT_TIMEOUT_S,
    JSON,
    Backend,
    Capabilities,
    Deployment,
    DeployRequest,
    ManifestMismatch,
    Sender,
    TransferError,
)
from harness.launch import RankDeployment
from harness.manifest import Manifest
from harness.paths.base import StagingReceiver

KEEP_FILES = 2  # a reader of the newest version is never disturbed by the trainer's clean-up


class FileSender(Sender):
    """Writes version v as `<root>/v<v>-<attempt>.safetensors`; a refused version may be sent again."""

    def __init__(self, root: Path):
        self.root = root
        self._attempts = itertools.count()
        self._files: list[Path] = []

    def init(self) -> JSON:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("*.tmp"):  # a trainer killed mid-write left it
            stale.unlink(missing_ok=True)
        return {"root": str(self.root)}

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        manifest = Manifest.build(version, named_tensors)
        path = self.root / f"v{version:010d}-{next(self._attempts):04d}.safetensors"
        tmp = path.with_suffix(".tmp")
        # contiguous copies: safetensors refuses strided views and tensors sharing storage (tied weights)
        tensors = {
            n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in named_tensors.items()
        }
        try:
            safetensors.torch.save_file(tensors, str(tmp))
            os.replace(tmp, path)
        except (OSError, safetensors.SafetensorError) as exc:
            tmp.unlink(missing_ok=True)
            raise TransferError(f"writing version {version} to {path} failed: {exc}") from exc
        self._files.append(path)
        while len(self._files) > KEEP_FILES:
            self._files.pop(0).unlink(missing_ok=True)
        return {"path": str(path), "manifest": manifest.to_json()}

    def transmit(self) -> None:
        """Nothing to move: prepare() published the file."""

    def reset(self) -> None:
        while self._files:
            self._files.pop().unlink(missing_ok=True)


class FileReceiver(StagingReceiver):
    """Loads the announced file; StagingReceiver verifies it against the manifest and commits."""

    root: Path | None = None

    def _init(self, init_info: JSON) -> None:
        if "root" not in init_info:
            raise ManifestMismatch(f"init_info {sorted(init_info)} has no 'root'")
        self.root = Path(init_info["root"]).resolve()

    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        assert self.root is not None, "init_transfer_engine first"
        path = Path(str(update_info.get("path", ""))).resolve()
        if not path.is_relative_to(self.root):
            raise ManifestMismatch(f"version {manifest.version}: {path} is outside {self.root}")
        try:
            return safetensors.torch.load_file(str(path))
        except (OSError, safetensors.SafetensorError) as exc:
            raise ManifestMismatch(f"version {manifest.version}: {path} unreadable: {exc}") from None


class FileBackend(Backend):
    name = "toy-file"
    capabilities = Capabilities(multi_receiver=True, max_receivers=8)

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s

    def build(self, request: DeployRequest) -> Deployment:
        return RankDeployment(
            sender=FileSender(Path(request.workdir) / "versions"),
            receiver_path="toy_sync.sync:FileReceiver",  # imported again in each rank process
            n_receivers=request.n_receivers,
            spec=request.spec,
            engine=request.engine,
            workdir=request.workdir,
            rank_init_info=lambda info, rank: info,
            timeout=self.timeout_s,
        )


def make_backend() -> FileBackend:
    """The factory `weightsync certify --backend toy_sync:make_backend` calls."""
    return FileBackend()
