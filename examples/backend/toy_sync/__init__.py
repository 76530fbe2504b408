"""toy_sync: a weight-sync backend written outside weightsync, certified by it.

`weightsync certify --backend toy_sync:make_backend` (or `toy_sync.sync:make_backend`)."""

from toy_sync.sync import FileBackend, make_backend

__all__ = ["FileBackend", "make_backend"]
