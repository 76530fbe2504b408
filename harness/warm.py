"""Warm processes: children forked from a server that has already imported torch and the harness, so a
rank's (re)start costs the rank's own work (building its engine), not the seconds of importing torch
again (10 s on a loaded 2-core host: a restart inside a push spent its whole budget there).

    ctx = warm.context()                                   # multiprocessing's forkserver, booted
    p = ctx.Process(target=warm.inherit, args=(warm.here(), rank_main, *args)); p.start()

The fork server starts once per process, with the environment of that moment; a child takes its
parent's environment, working directory and import path as they are when it is started (`here()`, applied by
`inherit` before the target runs), as a spawned child would. The server only imports: no CUDA (a child
may use the GPU: it is a fork of a process that never touched CUDA) and no Python thread (numpy's
OpenBLAS pool has a worker thread, which OpenBLAS rebuilds after a fork itself).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from harness.procs import pid_alive
from harness.registry import BUILTIN_BACKENDS

#: What the server imports before its first fork: torch, and the harness modules a rank process imports
#: (its loop, the reference and fault engines, every built-in backend's module and so its path's receiver).
PRELOAD = (
    "torch",
    "safetensors.torch",
    "harness.launch",
    "harness.engines.reference",
    "harness.faults.engines",
    *dict.fromkeys(path.partition(":")[0] for path in BUILTIN_BACKENDS.values()),
)

#: What the run's engines need besides (`preload_for_run`, before the first boot): whichever caller boots the
#: server first (a ceiling, a supervised rank, a deployment of the reference engine), the run's engine
#: ranks are then forks of a server that has imported it. Without it a vLLM run's server booted by the
#: first cell without vLLM, and each of its ranks imported vLLM itself: 72 % of the vLLM fault column's
#: CPU samples (py-spy, 2026-12-07).
_run_preload: tuple[str, ...] = ()
_lock = threading.Lock()
_booted: mp.context.BaseContext | None = None
#: Seconds the fork server took to boot (import PRELOAD) in this process; None until it has.
boot_s: float | None = None


def context(preload: tuple[str, ...] = ()) -> mp.context.BaseContext:
    """The forkserver context, its server booted (PRELOAD imported) before this returns: the first call
    pays the imports, once per process; a process it starts after that is a fork of the warm server.
    `preload`: more modules the server imports when it boots (an engine's own, `engine_preload`); asked
    for after the boot, a child imports them itself, as it would without the server."""
    global _booted, boot_s
    with _lock:
        if _booted is None or not _server_alive():  # a server that died is booted again, here
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(dict.fromkeys((*PRELOAD, *_run_preload, *preload))))
            t0 = time.monotonic()
            probe = ctx.Process(target=_noop, name="weightsync-warm-probe", daemon=True)
            probe.start()  # answered once the server has imported PRELOAD
            probe.join()
            boot_s = time.monotonic() - t0
            _booted = ctx
        return _booted


def preload_for_run(modules: tuple[str, ...]) -> None:
    """Modules every boot of this process's server imports from now on (the run's engines': the pytest
    plugin names them when it configures the run)."""
    global _run_preload
    with _lock:
        _run_preload = tuple(dict.fromkeys((*_run_preload, *modules)))


def engine_preload(engine: str | None) -> tuple[str, ...]:
    """What a rank serving `engine` (a name or 'pkg.module:factory') imports before it can build one: the
    factory's module and the modules it names in WARM_PRELOAD (vLLM's import: 16 s on a loaded 2-core host,
    paid again by every rank restart without the server)."""
    if engine is None:
        return ()
    import importlib

    from harness.registry import engine_path

    module_name = engine_path(engine).partition(":")[0]
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # the rank says why when it builds the engine
        return ()
    return (module_name, *getattr(module, "WARM_PRELOAD", ()))


def _server_alive() -> bool:
    """Whether this process's fork server runs (read from the kernel: reaping it is multiprocessing's job)."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid is not None and pid_alive(pid)


def _noop() -> None:
    pass


def here() -> tuple[dict[str, str], str, list[str]]:
    """This process's environment, working directory and import path, for a child to take (`inherit`)."""
    return dict(os.environ), os.getcwd(), list(sys.path)


def inherit(parent: tuple[dict[str, str], str, list[str]], target: Callable[..., Any], *args: Any) -> Any:
    """A warm child's entry: take the parent's environment, working directory and import path (`here()`
    at its start), then run `target(*args)`."""
    env, cwd, path = parent
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    try:
        os.chdir(cwd)
    except OSError:  # removed since: the server's own is as good as any
        pass
    from harness import phases  # the one preloaded module that reads the environment at import

    phases.set_enabled(os.environ.get(phases.ENV) == "1")
    return target(*args)
