"""Resolve what is under test: a built-in backend name or an import path `pkg.module:factory`."""

from __future__ import annotations

import importlib
import inspect
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
from harness.devices import normalize, run_device

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

#: Built-in backends run only when named (`--backend reshard`), never in a default selection nor beside it:
#: the resharded sync brings N trainer rank processes and TP engines of its own (harness/backends/reshard.py).
NAMED_BACKENDS: dict[str, str] = {
    "reshard": "harness.backends.reshard:make_backend",
}

BUILTIN_ENGINES: dict[str, str] = {
    "reference": DEFAULT_ENGINE,
    "reference-tied": "harness.engines.reference:make_tied_engine",
    "reference-bf16": "harness.engines.reference:make_bf16_engine",
    "reference-in-place": "harness.engines.reference:make_in_place_engine",
    "vllm": "harness.engines.vllm:make_engine",
    "vllm-server": "harness.engines.vllm_server:make_engine",  # its own process: for torchrun workers
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


def resolve_backend(name: str, device: str | None = None) -> Backend:
    """A built-in name (see BUILTIN_BACKENDS) or an import path to a factory. On a device other than the
    CPU (default: the run's), a built-in name means its GPU variant (BUILTIN_GPU_BACKENDS), and a factory
    that takes `device` gets it; one that does not is built as it is (it places its tensors itself)."""
    device = normalize(device) if device is not None else run_device()
    on_gpu = device != "cpu"
    if on_gpu and name in BUILTIN_BACKENDS and name not in BUILTIN_GPU_BACKENDS:
        raise BackendError(
            f"backend {name!r} has no GPU variant; GPU variants: {sorted(BUILTIN_GPU_BACKENDS)}"
        )
    path = (BUILTIN_GPU_BACKENDS.get(name) if on_gpu else None) or BUILTIN_BACKENDS.get(name)
    path = path or EXTRA_BACKENDS.get(name) or NAMED_BACKENDS.get(name, name)
    if on_gpu and name in NAMED_BACKENDS and not takes_device(load_object(NAMED_BACKENDS[name])):
        raise BackendError(f"backend {name!r} has no GPU variant yet (its code path runs on gloo)")
    if ":" not in path:
        known = sorted({**BUILTIN_BACKENDS, **EXTRA_BACKENDS, **NAMED_BACKENDS})
        raise BackendError(f"unknown backend {name!r}; built-in: {known}, or give 'pkg.module:factory'")
    factory = load_object(path)
    backend = factory(device=device) if on_gpu and takes_device(factory) else factory()
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


def takes_device(factory: Callable) -> bool:
    """Whether a factory takes the run's device (a `device` argument, or **kwargs)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "device" or p.kind is p.VAR_KEYWORD for p in params)


def make_engine(name: str | None, spec: WeightSpec | None, device: str | None = None) -> Engine:
    """Build an engine on `device` (default: the run's, harness.devices.run_device). A factory that takes
    no `device` argument builds CPU engines only: naming another device for it is refused."""
    factory: Callable[..., Engine] = load_object(engine_path(name))
    device = normalize(device) if device is not None else run_device()
    if takes_device(factory):
        return factory(spec, device=device)
    if device != "cpu":
        raise BackendError(
            f"engine {name or 'reference'!r} cannot be placed on {device}: its factory takes no 'device' "
            "argument (give it `device: str | None = None`)"
        )
    return factory(spec)


#: The GPU variant of each built-in backend, which `--device cuda` selects.
BUILTIN_GPU_BACKENDS: dict[str, str] = {
    "ipc": "harness.backends.ipc:make_cuda_backend",
    "broadcast": "harness.backends.broadcast:make_nccl_backend",
    "delta": "harness.backends.delta:make_nccl_backend",
    "delta-ipc": "harness.backends.delta:make_cuda_ipc_backend",
}


def engine_capabilities(name: str | None) -> Capabilities:
    """What the engine factory declares (`factory.capabilities`); one that declares nothing restricts nothing."""
    caps = getattr(load_object(engine_path(name)), "capabilities", ENGINE_UNRESTRICTED)
    if not isinstance(caps, Capabilities):
        raise BackendError(
            f"engine {name!r}: its factory's 'capabilities' is a {type(caps).__name__}, not Capabilities"
        )
    return caps
