"""The outermost ASGI layer: the bearer token, then a bounded, buffered body, before any routing."""

from __future__ import annotations

import hmac
import json

from harness.control.errors import BAD_REQUEST, ApiError


class Guard:
    """Outermost ASGI layer: bearer token on mutating methods, then a bounded, buffered body.

    Runs before routing and parsing, so an unauthenticated or oversized request costs no parsing and
    reaches no handler."""

    SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

    def __init__(self, app, token: str | None, max_body_bytes: int):
        self.app = app
        self._token = None if token is None else f"Bearer {token}".encode()  # None: authentication off
        self.max_body_bytes = max_body_bytes

    @staticmethod
    async def _reply(send, status: int, type_: str, message: str, headers: list | None = None) -> None:
        body = json.dumps(ApiError(status, type_, message).payload()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                + (headers or []),
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self._token is None:
            return True
        values = [v for k, v in headers if k.lower() == b"authorization"]
        return len(values) == 1 and hmac.compare_digest(values[0], self._token)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        if scope["method"] not in self.SAFE_METHODS and not self._authorized(headers):
            await self._reply(
                send,
                401,
                "Unauthorized",
                "missing or invalid bearer token",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        lengths = [v for k, v in headers if k.lower() == b"content-length"]
        if lengths:
            if len(lengths) > 1 or not lengths[0].isdigit():
                await self._reply(send, 400, BAD_REQUEST, "malformed Content-Length")
                return
            if int(lengths[0]) > self.max_body_bytes:
                await self._reply(
                    send,
                    413,
                    "PayloadTooLarge",
                    f"body of {int(lengths[0])} bytes > limit {self.max_body_bytes}",
                )
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reply(
                    send, 413, "PayloadTooLarge", f"body larger than the limit {self.max_body_bytes}"
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)
