"""The one translation between harness exceptions and what crosses a process or network boundary.

Three carriers, one rule (the class survives by its name, the message by its text, nothing by pickle):
- between the trainer and its rank processes: JSON `{"type", "message", "traceback"}` (`to_json` / `from_json`);
- over HTTP: vLLM's ErrorResponse body, whose `type` names the class, and the status each class answers with
  (`http_status`; the server side, `harness.control.errors`) read back by `from_http` (the client side);
- inside vLLM: a worker can only raise ValueError, so the harness's transport starts the message with the
  class name ("UnknownTensorError: ..."), and `from_message` finds it again wherever vLLM relayed the text.
"""

from __future__ import annotations

import builtins
import re
import traceback
from collections.abc import Mapping
from typing import Any

from harness import api
from harness.api import (
    BackendError,
    EngineStateError,
    LifecycleError,
    ManifestMismatch,
    TransferError,
    UnknownTensorError,
    VersionError,
    WeightSyncError,
)

#: Each harness error's HTTP status, the first match in order (subclasses before their bases); a ValueError
#: is what engines raise for a request they refuse (a prompt outside the vocabulary).
HTTP_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (BackendError, 400),
    (LifecycleError, 409),
    (VersionError, 409),
    (EngineStateError, 409),
    (UnknownTensorError, 422),
    (ManifestMismatch, 422),
    (TransferError, 502),  # the data plane failed: not the caller's request
    (TimeoutError, 504),
    (ValueError, 400),
)

#: Every harness error class by name (ManifestMismatch too, whose name does not end in "Error").
HARNESS_ERRORS: dict[str, type[WeightSyncError]] = {
    name: cls for name, cls in vars(api).items() if isinstance(cls, type) and issubclass(cls, WeightSyncError)
}
#: "VersionError: ..." anywhere in a relayed text (vLLM wraps a worker's message in its own words).
_NAMED = re.compile(r"\b(" + "|".join(sorted(HARNESS_ERRORS, key=len, reverse=True)) + r"): (.*)", re.DOTALL)


def harness_class(name: str) -> type[WeightSyncError] | None:
    """The harness error class of that name (harness.api), or None."""
    return HARNESS_ERRORS.get(name)


def error_class(name: str) -> type[Exception]:
    """The class an error named `name` is rebuilt as: a harness error, else a builtin exception, else
    RuntimeError (an unknown name never becomes something importable by name)."""
    cls = harness_class(name)
    if cls is not None:
        return cls
    builtin = getattr(builtins, name, None)
    return builtin if isinstance(builtin, type) and issubclass(builtin, Exception) else RuntimeError


def to_json(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def from_json(d: Mapping[str, Any], where: str) -> BaseException:
    """Rebuild the error raised on the other side: harness errors and builtins keep their class, the text
    says where it was raised, and `remote_traceback` holds the other side's traceback."""
    exc = error_class(str(d.get("type", "")))(f"{d.get('message', '')} [raised in {where}]")
    exc.remote_traceback = d.get("traceback", "")  # type: ignore[attr-defined]
    return exc


def http_status(exc: BaseException) -> int | None:
    """The status an error answers with over HTTP; None for one that is no answer (a crash: 500)."""
    return next((status for cls, status in HTTP_STATUS if isinstance(exc, cls)), None)


def from_message(message: str) -> tuple[type[WeightSyncError], str] | None:
    """The harness class a relayed text starts a sentence with, and the rest of its first line
    (vLLM's "Worker failed with error '<message>', please check the stack trace" tail cut off)."""
    m = _NAMED.search(message)
    if m is None:
        return None
    detail = m.group(2).strip().splitlines()[0] if m.group(2).strip() else ""
    detail = re.split(r"'?, please check the stack trace", detail)[0].rstrip("'\"} \\")
    return HARNESS_ERRORS[m.group(1)], detail


def from_http(status: int, body: Any, where: str) -> WeightSyncError | None:
    """The harness error an HTTP error answer stands for, or None where it names none. Our server names
    the class in the body's `type`; vLLM's bodies relay a worker's "VersionError: ..." as text."""
    type_, message = http_type_and_message(body)
    cls = harness_class(type_)
    if cls is None:
        named = _NAMED.match(message.lstrip("'\" {[("))  # vLLM relays a worker's "VersionError: ..." as text
        cls = HARNESS_ERRORS[named.group(1)] if named else None
    if cls is None:
        return None
    exc = cls(f"{message} {where}")
    exc.status = status  # type: ignore[attr-defined]
    return exc


def http_type_and_message(body: Any) -> tuple[str, str]:
    """An error answer's `type` and `message`, whatever its shape (ours, vLLM's, a plain text)."""
    if isinstance(body, Mapping):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, Mapping):
            type_ = str(err.get("type", "")) or (body["type"] if isinstance(body.get("type"), str) else "")
            return type_, str(err.get("message", err))
        return (body["type"] if isinstance(body.get("type"), str) else ""), str(err)
    return "", str(body)
