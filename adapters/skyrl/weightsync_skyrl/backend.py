"""SkyRL's delta sync behind weightsync's lifecycle, its code unmodified.

What maps to what:
- `Sender.prepare(version, tensors)` → `DeltaCheckpointPublisher.create_delta_files(tensors.items())` then
  `publish(result)`: SkyRL writes `delta-<n>/` (XOR against its last snapshot, zstd, xxh3-128 checksums,
  manifest last) under the run's sync directory. Its version counter is its own (it counts from 0 per
  publisher); update_info carries both numbers.
- `Receiver.update_weights` → `LocalCheckpointStore.fetch(n, sync_dir)`, `validate_ready(n)`, then the patched
  checkpoint read back (`CheckpointIndex.iter_tensors`) and cloned (the next fetch patches the same mmapped
  files); weightsync's StagingReceiver checks names, shapes and digests and commits at finish, as for
  every path.
- The base checkpoint both sides need (SkyRL's "pretrained model") is written by the sender at the first
  prepare of a run: zeros of the engines' weight spec, so version 1 is a patch of every tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

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

BASE_FILE = "model.safetensors"


class SkyrlDeltaSender(Sender):
    def __init__(self, root: Path, max_file_size_in_gb: float = 1.0):
        self.root = root
        self.max_file_size_in_gb = max_file_size_in_gb
        self._publisher = None
        self._run_dir: Path | None = None
        self.engine_spec = None  # set by the backend: the engines' weight spec (names, shapes, dtypes)

    def init(self) -> JSON:
        self.root.mkdir(parents=True, exist_ok=True)
        self._choose_run(new=False)
        return {"root": str(self.root)}

    def _choose_run(self, new: bool) -> None:
        """The run's directories (SkyRL's sync_dir, staging dir and base model are configuration): a trainer
        that starts again continues the newest run, as a restarted SkyRL trainer reuses its configured
        sync_dir with a publisher counting from 0 again; fresh engines (reset) start a new run, with a base
        of their own."""
        runs = sorted(self.root.glob("run-[0-9]*"))
        if runs and not new:
            self._run_dir = runs[-1]
        else:
            self._run_dir = self.root / f"run-{int(runs[-1].name[4:]) + 1 if runs else 0:04d}"
        (self._run_dir / "sync").mkdir(parents=True, exist_ok=True)
        self._publisher = None

    @property
    def run_dir(self) -> Path:
        """Where the versions are published (SkyRL's sync_dir): what the disk fault cells fill or clean."""
        assert self._run_dir is not None, "init first"
        return self._run_dir / "sync"

    def _start_publisher(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """SkyRL's publisher for the run, after its base checkpoint (written once per run)."""
        from weightsync_skyrl.skyrl_import import DeltaCheckpointPublisher

        assert self._run_dir is not None, "init first"
        base = self._run_dir / "base"
        if not (base / BASE_FILE).exists():
            base.mkdir(parents=True, exist_ok=True)
            # the engines' own names, shapes and dtypes (as SkyRL's base is the model the engines serve), so a
            # refused version never becomes part of the base
            spec = self.engine_spec() if self.engine_spec is not None else None
            shapes = (
                {n: (s.shape, s.dtype) for n, s in spec.items()}
                if spec
                else {n: (t.shape, t.dtype) for n, t in named_tensors.items()}
            )
            zeros = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in shapes.items()}
            safetensors.torch.save_file(zeros, str(base / BASE_FILE))
        self._publisher = DeltaCheckpointPublisher(
            base_model_path=str(base),
            sync_dir=str(self._run_dir / "sync"),
            publish_staging_dir=str(self._run_dir / "staging"),
            max_file_size_in_gb=self.max_file_size_in_gb,
            publish_num_workers=1,
        )

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        manifest = Manifest.build(version, named_tensors)
        if self._publisher is None:
            self._start_publisher(named_tensors)
        assert self._run_dir is not None and self._publisher is not None
        try:
            result = self._publisher.create_delta_files(
                (n, t.detach().cpu()) for n, t in named_tensors.items()
            )
            published = self._publisher.publish(result)
        except ValueError as exc:
            if "Shape mismatch" in str(exc):  # SkyRL refuses a tensor whose shape is not the base's
                raise ManifestMismatch(f"version {version}: SkyRL refused it: {exc}") from exc
            raise TransferError(f"SkyRL could not publish version {version}: ValueError: {exc}") from exc
        except (OSError, RuntimeError) as exc:
            raise TransferError(
                f"SkyRL could not publish version {version}: {type(exc).__name__}: {exc}"
            ) from exc
        return {
            "manifest": manifest.to_json(),
            "run": str(self._run_dir),
            "skyrl_version": int(published["target_version"]),
            "sync_dir": str(published["sync_dir"]),
        }

    def transmit(self) -> None:
        """Nothing to move: publish() wrote the delta; receivers fetch it."""

    def reset(self) -> None:
        self._choose_run(new=True)  # fresh engines: a new run, from its own base

    def reset_base(self) -> None:
        self._choose_run(new=True)  # engines may differ: a new run with their base


class SkyrlDeltaReceiver(StagingReceiver):
    """Fetches SkyRL's deltas into a LocalCheckpointStore of its own, then reads the patched checkpoint."""

    def __init__(self, engine):
        super().__init__(engine)
        self.root: Path | None = None
        self.rank = 0
        self._store = None
        self._run: str | None = None

    def _init(self, init_info: JSON) -> None:
        if "root" not in init_info:
            raise ManifestMismatch(f"init_info {sorted(init_info)} has no 'root'")
        self.root = Path(init_info["root"]).resolve()
        self.rank = int(init_info.get("rank", 0))

    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        from weightsync_skyrl.skyrl_import import CheckpointIndex, LocalCheckpointStore

        assert self.root is not None, "init_transfer_engine first"
        run = Path(str(update_info.get("run", ""))).resolve()
        if not run.is_relative_to(self.root):
            raise ManifestMismatch(f"version {manifest.version}: {run} is outside {self.root}")
        if self._run != str(run):
            self._store = LocalCheckpointStore(
                base_model_path=str(run / "base"), local_checkpoint_dir=str(run / f"receiver-{self.rank}")
            )
            self._run = str(run)
        target = int(update_info["skyrl_version"])
        try:
            self._store.fetch(target_version=target, sync_dir=str(update_info["sync_dir"]))
            self._store.validate_ready(target)
            # SkyRL makes its patched copy at the first delta that changes a byte; until then the engine's
            # weights are the base checkpoint's (a version of empty tensors changes none)
            weights = self._store.weights_dir if Path(self._store.weights_dir).is_dir() else run / "base"
            # the checkpoint holds every tensor; the version carries the manifest's (a partial update leaves
            # the rest of the engine as it is, as vLLM's load_weights does with the tensors it is given)
            wanted = set(manifest.names)
            return {n: t.clone() for n, t in CheckpointIndex(weights).iter_tensors() if n in wanted}
        except (OSError, RuntimeError, ValueError) as exc:
            raise TransferError(
                f"version {manifest.version}: SkyRL's fetch of its version {target} failed: {type(exc).__name__}: {exc}"
            ) from exc


class SkyrlDeltaBackend(Backend):
    name = "skyrl-delta"
    # several receivers read one published delta each; engines take any tensors (the base is made from the
    # first version). Not claimed: buckets (SkyRL splits files by its own size limit), interposable (no tap
    # in its writer), delta (weightsync's delta capability means its patch protocol, not SkyRL's).
    capabilities = Capabilities(multi_receiver=True, max_receivers=8)

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, max_file_size_in_gb: float = 1.0):
        self.timeout_s = timeout_s
        self.max_file_size_in_gb = max_file_size_in_gb

    def build(self, request: DeployRequest) -> Deployment:
        sender = SkyrlDeltaSender(Path(request.workdir) / "skyrl", self.max_file_size_in_gb)
        deployment = RankDeployment(
            sender=sender,
            receiver_path="weightsync_skyrl.backend:SkyrlDeltaReceiver",
            n_receivers=request.n_receivers,
            spec=request.spec,
            engine=request.engine,
            workdir=request.workdir,
            rank_init_info=lambda info, rank: {**info, "rank": rank},
            timeout=self.timeout_s,
        )
        sender.engine_spec = lambda: deployment.handles[0].engine.weight_spec()
        return deployment


def make_backend() -> SkyrlDeltaBackend:
    """The factory `weightsync certify --backend weightsync_skyrl:make_backend` calls."""
    return SkyrlDeltaBackend()
