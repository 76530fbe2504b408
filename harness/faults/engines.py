"""Engines with a fault switch: any engine factory, whose commit fails on demand (out of memory).

The trigger is a file `commit-fail-<pid>` in $WEIGHTSYNC_FAULT_DIR: the harness arms one rank's
engine by its pid; the engine consumes the trigger when it fires. The wrapped factory is named by
$WEIGHTSYNC_FAULT_INNER_ENGINE (default: the reference engine)."""

from __future__ import annotations

import os
from pathlib import Path

from harness.api import Engine, WeightSpec
from harness.faults.injectors import COMMIT_FAIL_DIR_ENV
from harness.registry import engine_path, load_object
from harness.registry import make_engine as make_named_engine

INNER_ENGINE_ENV = "WEIGHTSYNC_FAULT_INNER_ENGINE"


def make_engine(spec: WeightSpec | None = None, device: str | None = None) -> Engine:
    engine = make_named_engine(os.environ.get(INNER_ENGINE_ENV), spec, device)
    commit = engine.commit_weights

    def commit_weights(tensors, version: int) -> None:
        trigger = Path(os.environ.get(COMMIT_FAIL_DIR_ENV, "/nonexistent")) / f"commit-fail-{os.getpid()}"
        if trigger.exists():
            trigger.unlink(missing_ok=True)
            raise MemoryError(
                f"injected: out of memory while committing version {version} (pid {os.getpid()})"
            )
        commit(tensors, version)

    engine.commit_weights = commit_weights  # type: ignore[method-assign]
    return engine


# a rank leaves thread binding to engines that manage it (vLLM): the wrapper says what the wrapped says
make_engine.manages_threads = bool(  # type: ignore[attr-defined]
    getattr(load_object(engine_path(os.environ.get(INNER_ENGINE_ENV))), "manages_threads", False)
)
