"""Control servers for suites/meta/test_control_target.py, each started by a factory the control suites
take with `--weightsync-control-server` (harness/control/under_test.py): the harness's own server, and
a broken one the suites must fail."""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path
from typing import Any

from harness.control import schemas
from harness.control.app import ServerThread
from harness.control.server import ControlServer, ServerConfig
from harness.engines.reference import ReferenceEngine
from harness.paths.disk import DiskReceiver


class PublishesBeforeCommit(ControlServer):
    """Publishes the new version's label before the commit and keeps it when the commit is refused or
    fails: /weight_info names a version the engine never committed."""

    def _finish(self, weight_version: int | str | None, weight_label: str | None = None) -> dict[str, Any]:
        version, label = schemas.parse_version(weight_version)
        if self._updating:
            self._label = label or str(version if version is not None else self.lifecycle.version)
        return super()._finish(weight_version, weight_label)


class Started:
    """A control server in a thread of this process, as a factory returns it: url, token, data_dir, close()."""

    def __init__(self, server_cls: type[ControlServer], workdir: Path | None):
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="weightsync-ctl-")
        self.data_dir = Path(workdir if workdir is not None else self._tmp.name) / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_urlsafe(24)
        self.engine = ReferenceEngine(max_batch=8)
        self.receiver = DiskReceiver(self.engine)
        config = ServerConfig(token=self.token, allowed_dirs=(self.data_dir,))
        self.thread = ServerThread(server_cls(self.engine, self.receiver, config)).start()
        self.url = self.thread.url

    def read_weights(self):
        """The oracle: this process holds the engine."""
        return self.engine.read_weights()

    def close(self) -> None:
        self.thread.stop()
        self.receiver.shutdown()
        self.engine.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()


def start_reference(workdir: Path | None = None) -> Started:
    return Started(ControlServer, workdir)


def start_publishes_before_commit(workdir: Path | None = None) -> Started:
    return Started(PublishesBeforeCommit, workdir)
