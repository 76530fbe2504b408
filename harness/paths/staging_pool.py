"""Host memory a receiver stages versions in, reused once nothing else holds it.

A staged version becomes the engine's weights (ownership passes at commit), so a receiver cannot
simply overwrite last sync's buffers: the engine may still serve from them. But a fresh allocation
costs a first touch of every page, about five times a warm copy on a small host (64 MiB: 36 ms
against 7). The pool keeps each buffer's storage and hands it out again only when its use count
says no tensor but the pool's own handle references it: the engine dropped it at the next commit,
an aborted update dropped it, or a loading engine copied out of it. Any live view, numpy array or
request holding it keeps it out of reuse, so reuse can never change bytes someone still reads.

Memory: in steady state a receiver holds two versions (the engine's and a spare), which an update
needs at its peak anyway; `trim()` drops spares beyond what the last update used."""

from __future__ import annotations

import torch


def _free(storage: torch.UntypedStorage) -> bool:
    """Nothing but this handle references the storage (every tensor or view adds one)."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


class StagingPool:
    def __init__(self) -> None:
        self._kept: list[torch.UntypedStorage] = []
        self._taken_bytes = 0  # handed out since the last trim
        self.reused = 0  # buffers handed out again (tests and benchmarks read these)
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer of exactly `nbytes`: a free kept one, else a new one."""
        self._taken_bytes += nbytes
        for storage in self._kept:
            if storage.nbytes() == nbytes and _free(storage):
                self.reused += 1
                return torch.empty(0, dtype=torch.uint8).set_(storage)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._kept.append(buf.untyped_storage())
        self.allocated += 1
        return buf

    def trim(self) -> None:
        """After an update ends: keep free buffers up to the bytes it took (the next one's spares)."""
        budget, kept = self._taken_bytes, []
        for storage in self._kept:
            if not _free(storage):
                kept.append(storage)
            elif storage.nbytes() <= budget:
                budget -= storage.nbytes()
                kept.append(storage)
        self._kept, self._taken_bytes = kept, 0

    def clear(self) -> None:
        self._kept, self._taken_bytes = [], 0

    @property
    def kept_bytes(self) -> int:
        return sum(s.nbytes() for s in self._kept)
