"""Resolve what is under test: a built-in backend name or an import path `pkg.module:factory`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from harness.api import (
    DEFAULT_ENGINE,
    ENGINE_UNRESTRICTED,
    Backend,
    BackendError,
    Capabilities,
    Engine,
    WeightSpec,
)

BUILTIN_BACKENDS: dict[str, str] = {
    "disk": "harness.backends.disk:make_backend",
    "broadcast": "harness.backends.broadcast:make_backend",
    "ipc": "harness.backends.ipc:make_backend",
    "delta": "harness.backends.delta:make_backend",
    "delta-ipc": "harness.backends.delta:make_ipc_backend",
}

#: Named backends outside the default selection: the control plane needs a rank restart per fresh
#: engine, so it runs in the fault matrix (and on request), not through every conformance test.
EXTRA_BACKENDS: dict[str, str] = {
    "control": "harness.backends.control:make_backend",
}

BUILTIN_ENGINES: dict[str, str] = {
    "reference": DEFAULT_ENGINE,
    "reference-tied": "harness.engines.reference:make_tied_engine",
    "reference-bf16": "harness.engines.reference:make_bf16_engine",
    "reference-in-place": "harness.engines.reference:make_in_place_engine",
    "vllm": "harness.engines.vllm:make_engine",
}


def load_object(path: str) -> Any:
    """Import `pkg.module:attr` and return the attribute, with errors that say what went wrong."""
    if not isinstance(path, str) or ":" not in path:
        raise BackendError(f"{path!r} is not an import path of the form 'pkg.module:factory'")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendError(f"cannot import module {module_name!r} from {path!r}: {exc}") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise BackendError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    if not callable(obj):
        raise BackendError(f"{path!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def resolve_backend(name: str) -> Backend:
    """A built-in name (see BUILTIN_BACKENDS) or an import path to a zero-argument factory."""
    path = BUILTIN_BACKENDS.get(name) or EXTRA_BACKENDS.get(name, name)
    if ":" not in path:
        raise BackendError(
            f"unknown backend {name!r}; built-in: {sorted({**BUILTIN_BACKENDS, **EXTRA_BACKENDS})}, or give 'pkg.module:factory'"
        )
    backend = load_object(path)()
    for attr in ("name", "capabilities", "deploy"):
        if not hasattr(backend, attr):
            raise BackendError(f"factory {path!r} returned {type(backend).__name__}, which has no {attr!r}")
    return backend


def engine_path(name: str | None) -> str:
    name = name or "reference"
    path = BUILTIN_ENGINES.get(name, name)
    if ":" not in path:
        raise BackendError(
            f"unknown engine {name!r}; built-in: {sorted(BUILTIN_ENGINES)}, or give 'pkg.module:factory'"
        )
    return path


def make_engine(name: str | None, spec: WeightSpec | None) -> Engine:
    factory: Callable[[WeightSpec | None], Engine] = load_object(engine_path(name))
    return factory(spec)


def engine_capabilities(name: str | None) -> Capabilities:
    """What the engine factory declares (`factory.capabilities`); one that declares nothing restricts nothing."""
    caps = getattr(load_object(engine_path(name)), "capabilities", ENGINE_UNRESTRICTED)
    if not isinstance(caps, Capabilities):
        raise BackendError(
            f"engine {name!r}: its factory's 'capabilities' is a {type(caps).__name__}, not Capabilities"
        )
    return caps
