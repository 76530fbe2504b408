"""Deployments: a Sender wired to N engines, and the one driver that pushes a version through it."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Mapping

import torch

from harness.api import JSON, Deployment, Engine, EngineHandle, Sender, TransferError, WeightSpec, WeightSyncError
from harness.paths.base import StagingReceiver
from harness.registry import make_engine


class LocalDeployment(Deployment):
    """Engines and receivers in this process (disk, and any path whose receiver needs no rank)."""

    def __init__(
        self,
        sender: Sender,
        receiver_cls: Callable[[Engine], StagingReceiver],
        n_receivers: int,
        spec: WeightSpec | None,
        engine: str | None,
    ):
        self.sender = sender
        self._engine_name = engine
        self.init_info = sender.init()
        self.handles = []
        for _ in range(n_receivers):
            receiver = receiver_cls(make_engine(engine, spec))
            receiver.init_transfer_engine(self.init_info)
            self.handles.append(EngineHandle(receiver, receiver.engine))

    def reset(self, spec: WeightSpec | None = None) -> None:
        self.sender.reset()
        for h in self.handles:
            h.engine.shutdown()
            h.engine = make_engine(self._engine_name, spec)
            h.receiver.rebind(h.engine)  # type: ignore[attr-defined]

    def close(self) -> None:
        for h in self.handles:
            h.receiver.shutdown()
            h.engine.shutdown()
        self.sender.shutdown()


def deliver(
    deployment: Deployment, version: int, named_tensors: Mapping[str, torch.Tensor], timeout: float = 120.0
) -> JSON:
    """prepare(), then the data plane: transmit on the sender while every receiver runs
    update_weights. Re-raises the first error once every party has returned (or `timeout` passed).
    Returns the update_info that was delivered."""
    handles = deployment.handles
    update_info = deployment.sender.prepare(version, named_tensors)
    pool = cf.ThreadPoolExecutor(max_workers=len(handles) + 1, thread_name_prefix="deliver")
    futures = [pool.submit(deployment.sender.transmit)]
    futures += [pool.submit(h.receiver.update_weights, update_info) for h in handles]
    _, pending = cf.wait(futures, timeout=timeout)
    pool.shutdown(wait=False)  # a stuck party must not hang the trainer; the error says who
    if pending:
        raise TransferError(f"delivery of version {version}: {len(pending)} part(ies) still running after {timeout}s")
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
    return update_info


def push(
    deployment: Deployment, version: int, named_tensors: Mapping[str, torch.Tensor], timeout: float = 120.0
) -> None:
    """The full lifecycle, as a trainer drives it: start on every engine, deliver, finish(version)
    everywhere. If any party fails, every receiver that started discards the update and the first
    error is re-raised."""
    started = []
    try:
        for h in deployment.handles:
            h.receiver.start_weight_update()
            started.append(h)
        deliver(deployment, version, named_tensors, timeout)
    except BaseException:
        # No engine may commit a version another engine refused: discard everywhere.
        _abort_all(started)
        deployment.sender.complete(False)
        raise
    for i, h in enumerate(deployment.handles):
        try:
            h.receiver.finish_weight_update(version)
        except BaseException:
            _abort_all(deployment.handles[i + 1 :])
            # engines before i committed, i and after did not: the sender may not assume either
            deployment.sender.complete(False)
            raise
    deployment.sender.complete(True)


def _abort_all(handles) -> None:
    for h in handles:
        try:
            h.receiver.abort_weight_update()
        except WeightSyncError:  # a dead rank cannot abort; the original error is what matters
            pass
