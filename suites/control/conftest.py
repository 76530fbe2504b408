"""Fixtures of the control-plane suite: the control server under test, a ControlClient talking to it
over real HTTP, and a RemoteDeployment so `harness.deployment.push()` drives the server as any
deployment.

By default the server is the harness's own: a real uvicorn server on 127.0.0.1 (ephemeral port) in
front of a reference engine and a disk receiver. `--weightsync-control-url` or
`--weightsync-control-server` (harness/control/under_test.py) put another in its place; what a test
reaches through `served.engine`, `.server`, `.receiver` or `.thread` beyond HTTP, and every
`make_served(...)` asking for a configuration, makes it NOT_SUPPORTED there, with the reason, as does a
test that starts a server of its own (neither `served` nor `make_served`)."""

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
from harness.control.client import ControlClient, ControlHTTPError
from harness.control.remote import RemoteDeployment, RemoteEngine
from harness.control.server import ControlServer, ServerConfig
from harness.control.under_test import ControlTarget, data_dir_of, token_of
from harness.deployment import push
from harness.engines.reference import ReferenceEngine
from harness.paths.disk import DiskReceiver, DiskSender
from harness.pytest_plugin import NOT_SUPPORTED, control_target_of

_CONFIG_DEFAULTS = ServerConfig(token=None)


def pytest_configure(config: pytest.Config) -> None:
    control_target_of(config)  # a bad --weightsync-control-* combination is a usage error, before any test


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A plain `pytest suites/control` stays quick: the slow tier (the load benchmark, real vLLM) runs
    when a marker expression selects it (`-m slow`, `-m vllm`), as the nox sessions do."""
    if item.get_closest_marker("slow") and not item.config.getoption("markexpr", ""):
        pytest.skip("slow tier: select it with -m slow")
    target = control_target_of(item.config)
    fixtures = getattr(item, "fixturenames", ())
    if target.foreign and "served" not in fixtures and "make_served" not in fixtures:
        pytest.skip(
            f"{NOT_SUPPORTED}: checks the harness's own control server (it starts one of its own), not "
            f"{target.describe()}"
        )


@dataclasses.dataclass
class Served:
    """One running control server and everything a test reaches it with."""

    engine: ReferenceEngine  # a ForeignEngine (HTTP) for a foreign server
    receiver: DiskReceiver  # Unreachable for a foreign server
    thread: ServerThread  # Unreachable for a foreign server
    client: ControlClient
    deployment: RemoteDeployment
    root: Path  # the one directory update paths may name
    token: str
    _clients: list[ControlClient] = dataclasses.field(default_factory=list)
    foreign: Any = None  # the foreign server's object (harness/control/under_test.py); None: the reference

    @property
    def url(self) -> str:
        return self.foreign.url if self.foreign is not None else self.thread.url

    @property
    def server(self) -> ControlServer:
        if self.foreign is not None:
            not_supported("server object (ControlServer: counters, live streams, config, app)")
        return self.thread.server

    def new_client(self, **kwargs: Any) -> ControlClient:
        kwargs.setdefault("token", self.token)
        client = ControlClient(self.url, **kwargs)
        self._clients.append(client)
        return client

    def auth(self) -> dict[str, str]:
        """The header a request carries to this server: none where it takes no token (vLLM's dev routes)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def push(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """The full four-phase lifecycle over HTTP, the disk path as data plane."""
        push(self.deployment, version, tensors)

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.thread.stop()
        self.deployment.close()
        self.engine.shutdown()


def not_supported(what: str) -> None:
    pytest.skip(
        f"{NOT_SUPPORTED}: needs the reference control server's {what}, which a foreign server does not expose"
    )


class Unreachable:
    """Where the reference server has an object a test reaches into (its thread, receiver): against a
    foreign server, any use of it makes the test NOT_SUPPORTED, naming what it reached for."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        not_supported(f"{self._what}.{name}")

    def __repr__(self) -> str:
        return f"<unreachable {self._what}>"


def _not_supported_attribute(what: str) -> property:
    """An attribute of the reference engine that a test reads or sets: NOT_SUPPORTED either way against a
    foreign server."""

    def read(self):
        not_supported(what)

    def write(self, value):
        not_supported(f"{what} (set from the test)")

    return property(read, write)


class ForeignEngine(RemoteEngine):
    """`served.engine` of a foreign server: what HTTP answers (version, spec, generation, pause); the
    weights through the server object's `read_weights()` when it has one; anything else of the
    reference engine (its tokenizer, a commit counted or failed from inside) NOT_SUPPORTED."""

    def __init__(self, client: ControlClient, server: Any):
        super().__init__(client, oracle=getattr(server, "read_weights", None))
        self._server = server

    def weight_spec(self):
        own = getattr(self._server, "weight_spec", None)
        if callable(own):
            return own()
        try:
            return super().weight_spec()
        except ControlHTTPError as exc:
            if exc.status in (404, 405):
                pytest.skip(
                    f"{NOT_SUPPORTED}: the server has no /weight_spec and its factory's object no weight_spec()"
                )
            raise

    def read_weights(self):
        if self._oracle is None:
            pytest.skip(
                f"{NOT_SUPPORTED}: reads the engine's weights directly; the server under test offers no "
                "oracle (a factory's server object may expose read_weights())"
            )
        return self._oracle()

    def model_config(self):
        not_supported("engine.model_config() (an independent forward of its model)")

    tokenizer = _not_supported_attribute("engine.tokenizer")
    reports_logprobs = _not_supported_attribute("engine.reports_logprobs")

    @property
    def commit_weights(self):  # type: ignore[override]
        not_supported("engine.commit_weights (a commit counted or failed inside the engine)")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        not_supported(f"engine.{name}")


# make_served's parameters that configure the reference server; a foreign one takes none of them
_DEFAULTS = {"max_batch": 8, "server_cls": ControlServer, "limits": None, "thread_cls": ServerThread}


@pytest.fixture
def control_target(request) -> ControlTarget:
    """The control server under test (--weightsync-control-url / --weightsync-control-server)."""
    return control_target_of(request.config)


def _serve_foreign(target: ControlTarget, workdir: Path, n: int, started: list[tuple[Any, Served]]) -> Served:
    server = (
        target.start(workdir / f"server-{n}") if target.kind == "factory" or not started else started[0][0]
    )
    token = token_of(server, target)
    data_dir = data_dir_of(server, target) or workdir / "data"
    root = data_dir  # the directory the server confines paths to: its parent must be outside
    root.mkdir(parents=True, exist_ok=True)
    client = ControlClient(server.url, token=token)
    if target.kind == "url":
        if client.is_paused():  # an earlier test left it paused
            client.resume()
        label = client.weight_version()
        if label not in (None, "", "default"):
            client.close()
            pytest.skip(
                f"{NOT_SUPPORTED}: needs a fresh server (the one at {server.url} serves weight_version "
                f"{label!r}); --weightsync-control-server starts one per test"
            )
    oracle = getattr(server, "read_weights", None)
    deployment = RemoteDeployment(DiskSender(root / "checkpoints"), [client], [oracle])
    engine = ForeignEngine(client, server)
    served = Served(
        engine,
        Unreachable("receiver"),
        Unreachable("thread"),
        client,
        deployment,
        root,
        token or "",
        [client],
    )
    served.foreign = server
    started.append((server, served))
    return served


@pytest.fixture
def make_served(tmp_path: Path, control_target: ControlTarget) -> Iterator[Callable[..., Served]]:
    """Factory: `make_served(max_batch=8, server_cls=ControlServer, limits=ClientLimits(...), **ServerConfig
    fields)` starts a server (server_cls: a deliberately broken one, for the meta tests; limits: its
    deadlines and connection cap; thread_cls: how it runs, a broken one for the meta tests); all stop at
    teardown."""
    started: list[Served] = []
    foreign: list[tuple[Any, Served]] = []

    def make(
        max_batch: int = 8,
        server_cls: type[ControlServer] = ControlServer,
        limits: ClientLimits | None = None,
        thread_cls: type[ServerThread] = ServerThread,
        **config: Any,
    ) -> Served:
        if control_target.foreign:
            asked = dict(max_batch=max_batch, server_cls=server_cls, limits=limits, thread_cls=thread_cls)
            asked = {k: v for k, v in asked.items() if v is not _DEFAULTS[k]}
            asked |= {k: v for k, v in config.items() if getattr(_CONFIG_DEFAULTS, k, object()) != v}
            if asked:
                not_supported(f"configuration {sorted(asked)}")
            return _serve_foreign(control_target, tmp_path, len(foreign), foreign)
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
    for server, s in foreign:
        for c in s._clients:
            c.close()
        s.deployment.sender.shutdown()
        if control_target.kind == "factory":
            server.close()


@pytest.fixture
def served(make_served) -> Served:
    return make_served()
