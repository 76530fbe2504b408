"""Which control server the control suites (suites/control) certify: the harness's own (the default),
one already running at a URL, or one a factory starts for each test.

    pytest suites/control                                                   # the harness's own server
    pytest suites/control --weightsync-control-server mypkg.serve:start     # a fresh server per test
    pytest suites/control --weightsync-control-url http://127.0.0.1:8000 \\
        --weightsync-control-token "$TOKEN" --weightsync-control-dir /shared/weightsync

A factory (`pkg.module:factory`) is called once per test, with `workdir=` (a fresh directory) when it
takes that parameter, and returns a started server object. It must expose `url` and `close()`; it may
expose `token` (the bearer token the server wants on mutating routes), `data_dir` (a directory the
server reads checkpoints from), `weight_spec()` (name -> `harness.api.TensorSpec`, where the server has
no `/weight_spec`) and `read_weights()` (name -> tensor: the oracle, what the engine computes with,
read some other way than the sync path). A URL names one server shared by every test of the run: the
tests that push versions from the start need it fresh (`/weight_info` at `default`) and are
NOT_SUPPORTED once it is not; a factory gives each test a fresh one.

What a foreign server must accept (the suites push versions the way harness/control/remote.py does):
- the lifecycle routes of vLLM 0.32 (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`, `/weight_info`), bodies as `harness.control.routes.ROUTES`;
- the disk data plane: `init_info` `{"root": DIR}` and `update_info` `{"manifest", "path"}` as
  `harness.paths.disk.DiskSender` writes them (safetensors shards and a manifest under DIR, which lies
  under the data directory: the server must read it, i.e. run on this machine or share the directory).

Tests that need the reference server's insides (its engine's weights without an oracle, a fault
injected into its engine or receiver, its counters, its configuration, a CLI of its own) are
NOT_SUPPORTED against any other server, with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

from harness.registry import load_object

REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class ControlTarget:
    """The control server under test, as the command line names it."""

    url: str | None = None
    token: str | None = None
    factory: str | None = None
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.url and self.factory:
            raise ValueError(
                "--weightsync-control-url and --weightsync-control-server name two servers: pass one"
            )
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--weightsync-control-url {self.url!r}: not an http(s) URL")
        if self.factory and ":" not in self.factory:
            raise ValueError(f"--weightsync-control-server {self.factory!r}: expected pkg.module:factory")

    @property
    def kind(self) -> str:
        return "url" if self.url else "factory" if self.factory else REFERENCE

    @property
    def foreign(self) -> bool:
        """Anything but the harness's own server, started by the suite's fixtures."""
        return self.kind != REFERENCE

    def describe(self) -> str:
        if self.url:
            return f"the server at {self.url}" + (" (token given)" if self.token else " (no token)")
        if self.factory:
            return f"servers started by {self.factory}"
        return "the harness's own server (harness.control.server)"

    def start(self, workdir: Path) -> Any:
        """A started server object: the factory's, or for a URL one that stops nothing."""
        if self.url:
            return UrlServer(self.url.rstrip("/"), self.token, self.data_dir)
        if not self.factory:
            raise ValueError("the reference server is started by the suite's fixtures, not by its target")
        factory = load_object(self.factory)
        try:
            takes_workdir = "workdir" in inspect.signature(factory).parameters
        except (TypeError, ValueError):
            takes_workdir = False
        server = factory(workdir=workdir) if takes_workdir else factory()
        missing = [name for name in ("url", "close") if not hasattr(server, name)]
        if missing:
            raise TypeError(f"{self.factory} returned {type(server).__name__}, which lacks {missing}")
        return server


@dataclasses.dataclass
class UrlServer:
    """A server someone else started: its URL, the token and data directory given on the command line."""

    url: str
    token: str | None = None
    data_dir: Path | None = None

    def close(self) -> None:
        """Not ours to stop."""


def token_of(server: Any, target: ControlTarget) -> str | None:
    return getattr(server, "token", None) or target.token


def data_dir_of(server: Any, target: ControlTarget) -> Path | None:
    found = getattr(server, "data_dir", None) or target.data_dir
    return Path(found) if found is not None else None
