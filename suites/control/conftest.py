"""Fixtures of the control-plane suite: a real uvicorn server on 127.0.0.1 (ephemeral port) in front of
a reference engine and a disk receiver, a ControlClient talking to it over real HTTP, and a
RemoteDeployment so `harness.deployment.push()` drives the server as any deployment."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# the optional `control` extra; without it the suite is skipped, not broken
for _dependency in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_dependency)

from harness.control.app import ClientLimits, ServerThread
from harness.control.client import ControlClient
from harness.control.remote import RemoteDeployment
from harness.control.server import ControlServer, ServerConfig
from harness.deployment import push
from harness.engines.reference import ReferenceEngine
from harness.paths.disk import DiskReceiver, DiskSender


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A plain `pytest suites/control` stays quick: the slow tier (the load benchmark, real vLLM) runs
    when a marker expression selects it (`-m slow`, `-m vllm`), as the nox sessions do."""
    if item.get_closest_marker("slow") and not item.config.getoption("markexpr", ""):
        pytest.skip("slow tier: select it with -m slow")


@dataclasses.dataclass
class Served:
    """One running control server and everything a test reaches it with."""

    engine: ReferenceEngine
    receiver: DiskReceiver
    thread: ServerThread
    client: ControlClient
    deployment: RemoteDeployment
    root: Path  # the one directory update paths may name
    token: str
    _clients: list[ControlClient] = dataclasses.field(default_factory=list)

    @property
    def url(self) -> str:
        return self.thread.url

    @property
    def server(self) -> ControlServer:
        return self.thread.server

    def new_client(self, **kwargs: Any) -> ControlClient:
        kwargs.setdefault("token", self.token)
        client = ControlClient(self.url, **kwargs)
        self._clients.append(client)
        return client

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def push(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """The full four-phase lifecycle over HTTP, the disk path as data plane."""
        push(self.deployment, version, tensors)

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.thread.stop()
        self.deployment.close()
        self.engine.shutdown()


@pytest.fixture
def make_served(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Factory: `make_served(max_batch=8, server_cls=ControlServer, limits=ClientLimits(...), **ServerConfig
    fields)` starts a server (server_cls: a deliberately broken one, for the meta tests; limits: its
    deadlines and connection cap; thread_cls: how it runs, a broken one for the meta tests); all stop at
    teardown."""
    started: list[Served] = []

    def make(
        max_batch: int = 8,
        server_cls: type[ControlServer] = ControlServer,
        limits: ClientLimits | None = None,
        thread_cls: type[ServerThread] = ServerThread,
        **config: Any,
    ) -> Served:
        root = tmp_path / f"allowed-{len(started)}"
        root.mkdir()
        token = secrets.token_urlsafe(24)
        engine = ReferenceEngine(max_batch=max_batch)
        receiver = DiskReceiver(engine)
        cfg = ServerConfig(token=token, allowed_dirs=(root,), **config)
        thread = thread_cls(server_cls(engine, receiver, cfg), limits=limits).start()
        client = ControlClient(thread.url, token=token)
        deployment = RemoteDeployment(DiskSender(root / "checkpoints"), [client], [engine.read_weights])
        served = Served(engine, receiver, thread, client, deployment, root, token, [client])
        started.append(served)
        return served

    yield make
    for s in started:
        s.close()


@pytest.fixture
def served(make_served) -> Served:
    return make_served()
