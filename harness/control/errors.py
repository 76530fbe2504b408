"""Errors on the wire: vLLM's ErrorResponse shape, and the one map from harness exceptions to HTTP.

Every error answer is `{"error": {"message", "type", "param", "code"}}`. `type` names the harness
exception (the client maps it back, `harness.control.client.error_from_response`), the status comes
from `harness.error_codec.HTTP_STATUS`, and a refused field is named in `param` as vLLM spells it (`body.new_version`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from harness.api import (
    WeightSyncError,
)
from harness.control.schemas import BadRequest
from harness.error_codec import http_status

log = logging.getLogger("weightsync.control")

BAD_REQUEST = "Bad Request"  # vLLM's error type for a request that fails validation (the status phrase)


class ApiError(Exception):
    """An error answer in vLLM's ErrorResponse shape: status, a type name the client maps back to a
    harness error, a message, and `param`, the refused field ("query.mode", "body.new_version")."""

    def __init__(self, status: int, type_: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.param = status, type_, message, param

    def payload(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


def invalid(message: str, param: str | None) -> ApiError:
    """A request that fails validation: vLLM answers 400 with the field named in `param`."""
    return ApiError(400, BAD_REQUEST, message, param)


def api_error(exc: BaseException) -> ApiError | None:
    """The answer an exception raised by an operation gets (None: it is a crash, answered 500)."""
    status = 400 if isinstance(exc, BadRequest) else http_status(exc)
    if status is None:
        return None
    param = getattr(exc, "param", None)
    if param is not None or isinstance(exc, BadRequest):  # a refused request: vLLM's 400 shape
        return invalid(str(exc), param)
    return ApiError(status, type(exc).__name__, str(exc))


# pydantic names union branches and validator wrappers in an error's location; a client knows fields
_SCHEMA_KINDS = frozenset(
    {"function-after", "function-before", "function-wrap", "function-plain", "nullable"}
)
_SCHEMA_KINDS |= frozenset({"union", "tagged-union", "lax-or-strict", "json-or-python", "chain", "default"})
_SCHEMA_KINDS |= frozenset({"str", "int", "float", "bool", "list", "dict", "none", "constrained-str"})


def _field_path(loc: tuple[Any, ...], prefix: str) -> str:
    """`prefix.field.sub`: a pydantic error location as vLLM's `param` spells it."""
    parts = [prefix] if prefix and (not loc or loc[0] != prefix) else []
    for p in loc:
        text = str(p)
        if (
            any(c in text for c in "[](){}")
            or text.lower() in _SCHEMA_KINDS
            or text.startswith("constrained-")
        ):
            continue
        parts.append(text)
    return ".".join(parts)


def validation_error(exc: ValidationError | RequestValidationError, prefix: str = "body") -> ApiError:
    """400 naming the first refused field in `param`, the first ten errors in the message."""
    errors = exc.errors()
    parts = []
    for err in errors[:10]:
        parts.append(f"{_field_path(tuple(err.get('loc', ())), prefix)}: {err.get('msg', 'invalid')}")
    param = _field_path(tuple(errors[0].get("loc", ())), prefix) if errors else prefix
    return invalid("; ".join(parts) or "validation error", param)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """vLLM's error object, as every error answer carries it (the OpenAPI document's error schema)."""

    error: ErrorInfo


def install_handlers(app: FastAPI) -> None:
    """Every exception that reaches FastAPI leaves as vLLM's error object."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.payload(), status_code=exc.status)

    @app.exception_handler(BadRequest)
    @app.exception_handler(WeightSyncError)
    async def _refused(request: Request, exc: Exception):
        err = api_error(exc) or ApiError(400, type(exc).__name__, str(exc))
        return JSONResponse(err.payload(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return JSONResponse(validation_error(exc, prefix="").payload(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return JSONResponse(
            ApiError(exc.status_code, "HTTPError", str(exc.detail)).payload(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(ApiError(500, type(exc).__name__, "internal error").payload(), status_code=500)
