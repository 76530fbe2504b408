"""SkyRL's delta classes, imported unmodified.

skyrl 0.4.0 declares Python >= 3.12. On 3.11 its `skyrl.backends` package `__init__` fails at import
(pydantic refuses `typing.TypedDict` before 3.12, in `skyrl.tinker.types`), while the delta modules
themselves import fine: the package is registered by its path alone, so that `__init__` never runs."""

from __future__ import annotations

import os
import sys
import types

if sys.version_info < (3, 12) and "skyrl.backends" not in sys.modules:
    import skyrl

    _package = types.ModuleType("skyrl.backends")
    _package.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
    sys.modules["skyrl.backends"] = _package

from skyrl.backends.skyrl_train.weight_sync.delta.checkpoint import (
    CheckpointIndex,
    DeltaCheckpointPublisher,
    LocalCheckpointStore,
)

__all__ = ["CheckpointIndex", "DeltaCheckpointPublisher", "LocalCheckpointStore"]
