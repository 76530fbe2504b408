"""Idempotency-Key: a retried mutating request gets the first attempt's answer and never runs twice."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from harness.control.errors import ApiError


def fingerprint(path: str, query: list[tuple[str, str]], body: Any) -> str:
    """What a key is bound to: the route, its query and its body; the same key with another is a 422."""
    dumped = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
    return hashlib.sha256(json.dumps([path, sorted(query), dumped], sort_keys=True).encode()).hexdigest()


class IdempotencyCache:
    """Answers of mutating requests by `Idempotency-Key`, so a retry never runs an operation twice.

    A retry that arrives while the first attempt still runs waits for that attempt's answer. The
    operation runs as its own task, so a client that disconnects cannot cancel it half-way."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, tuple[str, asyncio.Future]] = collections.OrderedDict()
        self.replays = 0

    def knows(self, key: str | None) -> bool:
        """Whether `key` has an answer here (given or on its way): its retry replays, never re-runs."""
        return key is not None and key in self._entries

    async def run(
        self, key: str, fingerprint: str, op: Callable[[], Awaitable[tuple[int, dict[str, Any]]]]
    ) -> tuple[int, dict[str, Any]]:
        entry = self._entries.get(key)
        if entry is not None:
            if entry[0] != fingerprint:
                raise ApiError(
                    422, "IdempotencyKeyReused", f"Idempotency-Key {key!r} was used for another request"
                )
            self._entries.move_to_end(key)
            self.replays += 1
            return await asyncio.shield(entry[1])
        task = asyncio.ensure_future(op())
        self._entries[key] = (fingerprint, task)
        while len(self._entries) > self.capacity:
            oldest = next(iter(self._entries))
            if not self._entries[oldest][1].done():
                break
            del self._entries[oldest]
        try:
            return await asyncio.shield(task)
        except BaseException:
            if task.done() and task.exception() is not None:
                self._entries.pop(key, None)  # an unexpected crash is not an answer worth replaying
            raise
