"""The receiver lifecycle every path shares: stage, verify, then commit atomically.

A path only says how bytes arrive (`_receive`); this class owns the rules: calls in order, names and
shapes the engine knows, digests that match the manifest, a version newer than the committed one.
Anything wrong raises a specific error and leaves the engine on its last committed version.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping

import torch

from harness import phases
from harness.api import JSON, Engine, InPlaceLoad, ManifestMismatch, Receiver, WeightSyncError
from harness.lifecycle import NEW, READY, UPDATING, Lifecycle
from harness.manifest import Manifest, dtype_name
from harness.paths.staging_pool import StagingPool


def manifest_of(update_info: JSON) -> Manifest:
    if not isinstance(update_info, Mapping) or "manifest" not in update_info:
        raise ManifestMismatch("update_info carries no 'manifest'")
    return Manifest.from_json(update_info["manifest"])


def check_against_engine(engine: Engine, manifest: Manifest) -> None:
    """Refuse, naming tensor and version, anything the engine cannot hold."""
    v = manifest.version
    engine.check_update(manifest.names, v)
    spec = engine.weight_spec()
    for e in manifest.entries:
        s = spec[e.name]
        if e.shape != s.shape or e.dtype != dtype_name(s.dtype):
            raise ManifestMismatch(
                f"version {v}: tensor {e.name!r} is {e.shape} {e.dtype}, engine holds {s.shape} {dtype_name(s.dtype)}"
            )


class StagingReceiver(Receiver, abc.ABC):
    """Receiver with the shared lifecycle; subclasses implement `_init` and `_receive`."""

    #: True for collective paths: the receiver must consume the bytes even when it will refuse them,
    #: or the sender and the other ranks would block on it.
    must_drain = False

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lc = Lifecycle()
        self._staged: dict[str, torch.Tensor] = {}
        self._load: InPlaceLoad | None = None  # engines that load in place: the open load of this version
        self._arrived: set[str] = set()  # names delivered for this version (staged or written in place)
        self._mutex = threading.Lock()
        self.staging = StagingPool()  # host buffers a path receives into, reused once the engine lets go

    @property
    def state(self) -> str:
        return self._lc.state

    def engine_device(self) -> torch.device:
        """Where the engine keeps its weights (its `device`; the host for an engine that names none):
        what a path hands it, so a GPU engine never takes a host hop."""
        return torch.device(getattr(self.engine, "device", None) or "cpu")

    def rebind(self, engine: Engine) -> None:
        """Deliver into another engine from now on (the transport stays up)."""
        with self._mutex:
            self.engine = engine
            self._reset(READY if self._lc.state != NEW else NEW)

    def _reset(self, state: str) -> None:
        self._lc.to(state)
        self._staged = {}
        self._arrived = set()
        self._drop_load()

    def _drop_load(self) -> None:
        """An update that ends without a commit leaves the committed version, bit for bit."""
        load, self._load = self._load, None
        if load is not None:
            load.rollback()

    # ------------------------------------------------------------------ lifecycle
    def init_transfer_engine(self, init_info: JSON) -> None:
        with self._mutex:
            self._lc.check_init(init_info)
            self._init(dict(init_info))
            self._reset(READY)

    def start_weight_update(self) -> None:
        with self._mutex:
            self._lc.check_start()
            self._reset(UPDATING)

    def update_weights(self, update_info: JSON) -> None:
        with self._mutex, phases.role("receiver"):
            self._lc.check_update()
            try:
                manifest = manifest_of(update_info)
                refusal = None
                try:
                    self._lc.check_not_failed()
                    check_against_engine(self.engine, manifest)
                    self._lc.check_same_version(manifest.version)
                    twice = sorted(set(manifest.names) & self._arrived)
                    if twice:
                        raise ManifestMismatch(
                            f"version {manifest.version}: tensor(s) {twice[:5]} sent twice"
                        )
                except WeightSyncError as exc:
                    if not self.must_drain:
                        raise
                    refusal = exc
                if refusal is not None:
                    try:
                        self._receive(manifest, dict(update_info))  # drained only; the refusal is the answer
                    except WeightSyncError:
                        pass
                    raise refusal
                self.verified_in_transfer = set()  # names a path checked while copying them out (GPU)
                received = self._receive(manifest, dict(update_info))
                for name in manifest.names:
                    if name not in received:
                        raise ManifestMismatch(f"version {manifest.version}: tensor {name!r} did not arrive")
                manifest.verify_all(
                    {name: received[name] for name in manifest.names if name not in self.verified_in_transfer}
                )
                if self.engine.loads_in_place:  # streamed into the live weights now, as vLLM loads
                    if self._load is None:
                        self._load = self.engine.begin_in_place_load(manifest.version)
                    self._load.write({name: received[name] for name in manifest.names})
            except WeightSyncError as exc:
                self._lc.fail(exc)
                self._staged = {}
                self._drop_load()
                raise
            if not self.engine.loads_in_place:
                self._staged.update(received)
            self._arrived.update(manifest.names)
            self._lc.accepted(manifest.version)

    def finish_weight_update(self, version: int) -> None:
        with self._mutex:
            self._lc.check_finish(version)  # a failed update staged nothing (update_weights emptied it)
            staged = self._staged
            try:
                with phases.role("receiver"), phases.phase("commit"):
                    if self._load is not None:
                        self._load.commit()
                        self._load = None
                    else:
                        self.engine.commit_weights(staged, version)
            finally:
                self._reset(READY)
                self.staging.trim()

    def abort_weight_update(self) -> None:
        with self._mutex:
            self._lc.check_abort()
            self._reset(READY)
            self.staging.trim()

    def shutdown(self) -> None:
        with self._mutex:
            self._shutdown()
            self._reset(NEW)
            self.staging.clear()

    # ------------------------------------------------------------------ path hooks
    @abc.abstractmethod
    def _init(self, init_info: JSON) -> None:
        """Connect the data plane."""

    @abc.abstractmethod
    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        """Fetch every tensor of `manifest` (copies, on CPU); the base class verifies them."""

    def _shutdown(self) -> None:
        pass
