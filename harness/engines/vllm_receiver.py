"""The harness lifecycle mapped one to one onto vLLM's (`VllmReceiver`), and the deployment that wires
the disk path's `DiskSender` to one vLLM engine through it (`VllmDeployment`).

The trainer side is the disk path's sender (safetensors shards + manifest); vLLM loads them through
the harness's transport registered in its weight-transfer factory (harness.engines.vllm_transport),
so `harness.deployment.push()` drives vLLM's own lifecycle (init_weight_transfer_engine,
start_weight_update, update_weights, finish_weight_update).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from harness.api import (
    JSON,
    BackendError,
    Deployment,
    EngineHandle,
    ManifestMismatch,
    Receiver,
    WeightSpec,
    WeightSyncError,
)
from harness.lifecycle import FAILED, NEW, READY, UPDATING, Lifecycle
from harness.paths.base import check_against_engine, manifest_of
from harness.paths.disk import DiskSender


class VllmEngine(Protocol):
    """What this receiver drives: vLLM's own lifecycle on an `Engine` (harness.engines.vllm_adapter's
    VllmEngine, in process or behind the dev-mode server). Named here as a protocol so the receiver does not
    import the adapter that imports it."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, *args: Any, **kwargs: Any) -> None: ...
    def discard_update(self) -> None: ...
    def finish_weight_update(self, version: str) -> None: ...
    def reset_prefix_cache(self) -> Any: ...
    def weight_spec(self) -> WeightSpec: ...
    def shutdown(self) -> None: ...


class VllmReceiver(Receiver):
    """The harness lifecycle mapped one to one onto vLLM's, for `push()`.

    Before anything reaches vLLM it applies the harness's rules (calls in order, a version newer than
    the served one, names and shapes the model has); the worker-side transport then checks the bytes
    (manifest, digests, whole fused groups) before the model is touched.

    `reset_prefix_cache_after_commit`: vLLM 0.32 keeps prefix-cache blocks computed with the old
    weights across an update (see suites/vllm/test_vllm_findings.py), so a trainer must reset it; this
    receiver does, after every commit."""

    reset_prefix_cache_after_commit = True

    def __init__(self, engine: VllmEngine):
        self.engine = engine
        self._lc = Lifecycle()
        self._mutex = threading.Lock()

    @property
    def state(self) -> str:
        return self._lc.state

    def rebind(self, engine: VllmEngine) -> None:
        with self._mutex:
            self.engine = engine
            self._lc.to(NEW)

    def init_transfer_engine(self, init_info: JSON) -> None:
        with self._mutex:
            self._lc.check_init(init_info)
            self.engine.init_weight_transfer_engine(dict(init_info))
            self._lc.to(READY)

    def start_weight_update(self) -> None:
        with self._mutex:
            self._lc.check_start()
            if self._lc.failed:  # vLLM still holds the refused update open: close it first
                self._close_open_update()
            self.engine.start_weight_update()
            self._lc.to(UPDATING)

    def update_weights(self, update_info: JSON) -> None:
        with self._mutex:
            self._lc.check_update()
            try:
                self._lc.check_not_failed()
                manifest = manifest_of(update_info)
                check_against_engine(self.engine, manifest)
                self._lc.check_same_version(manifest.version)
                if "path" not in update_info:
                    raise ManifestMismatch(
                        f"version {manifest.version}: update_info has no checkpoint 'path'"
                    )
                self.engine.update_weights(
                    {"path": str(update_info["path"]), "manifest": update_info["manifest"]}
                )
            except WeightSyncError as exc:
                self._lc.fail(exc)
                raise
            self._lc.accepted(manifest.version)

    def finish_weight_update(self, version: int) -> None:
        with self._mutex:
            if self._lc.failed:
                try:
                    self.engine.discard_update()
                finally:
                    self._lc.check_finish(version)  # raises, naming why the update failed, and closes it
            self._lc.check_finish(version)
            try:
                self.engine.finish_weight_update(str(version))
            finally:
                self._lc.to(READY)
            if self.reset_prefix_cache_after_commit:
                self.engine.reset_prefix_cache()

    def abort_weight_update(self) -> None:
        with self._mutex:
            self._lc.check_abort()
            if self._lc.state in (UPDATING, FAILED):
                self._close_open_update()
            self._lc.to(READY)

    def _close_open_update(self) -> None:
        try:
            self.engine.discard_update()
        finally:
            self._lc.to(READY)

    def shutdown(self) -> None:
        with self._mutex:
            self._lc.to(NEW)


class VllmDeployment(Deployment):
    """A DiskSender wired to one vLLM engine (made by `make_engine`) through a VllmReceiver."""

    def __init__(self, make_engine: Callable[[], VllmEngine], workdir: str | os.PathLike):
        self._make_engine = make_engine
        self.sender = DiskSender(Path(workdir) / "checkpoints")
        self.init_info = self.sender.init()
        engine = make_engine()
        receiver = VllmReceiver(engine)
        receiver.init_transfer_engine(self.init_info)
        self.handles = [EngineHandle(receiver, engine)]

    def reset(self, spec: WeightSpec | None = None) -> None:
        """A fresh engine at version 0 (vLLM cannot be rolled back): restart it."""
        for h in self.handles:
            if spec is not None and dict(spec) != h.engine.weight_spec():
                raise BackendError("vLLM serves a fixed model; a deployment cannot take another weight spec")
            h.engine.shutdown()
            h.engine = self._make_engine()
            h.receiver.rebind(h.engine)  # type: ignore[attr-defined]
            h.receiver.init_transfer_engine(self.init_info)

    def close(self) -> None:
        for h in self.handles:
            h.receiver.shutdown()
            h.engine.shutdown()
        self.sender.shutdown()
