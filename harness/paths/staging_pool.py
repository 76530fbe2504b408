"""Host memory a receiver stages versions in, reused once nothing else holds it.

A staged version becomes the engine's weights (ownership passes at commit), so a receiver cannot
simply overwrite last sync's buffers: the engine may still serve from them. But a fresh allocation
costs a first touch of every page, about five times a warm copy on a small host (64 MiB: 36 ms
against 7). The pool keeps each buffer's storage and hands it out again only when its use count
says no tensor but the pool's own handle references it: the engine dropped it at the next commit,
an aborted update dropped it, or a loading engine copied out of it. Any live view, numpy array or
request holding it keeps it out of reuse, so reuse can never change bytes someone still reads.

Memory: in steady state a receiver holds two versions (the engine's and a spare), which an update
needs at its peak anyway; `trim()` drops spares beyond what the last update used, size by size."""

from __future__ import annotations

import torch


def _free(storage: torch.UntypedStorage) -> bool:
    """Nothing but this handle references the storage (every tensor or view adds one)."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


class StagingPool:
    def __init__(self) -> None:
        # by size, least recently handed out first: in steady state the front one is last version's,
        # which the engine let go of (a model has hundreds of same-size tensors: a take is one check)
        self._kept: dict[int, list[torch.UntypedStorage]] = {}
        self._taken: dict[int, int] = {}  # buffers handed out since the last trim, by size
        self.reused = 0  # buffers handed out again (tests and benchmarks read these)
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer of exactly `nbytes`: a free kept one, else a new one."""
        self._taken[nbytes] = self._taken.get(nbytes, 0) + 1
        same = self._kept.setdefault(nbytes, [])
        # only the least recently handed out is looked at: the ones after it were handed out later and
        # are held too (a scan would cost n^2 checks on the sync after the first); trim() bounds the rest
        if same and _free(same[0]):
            storage = same.pop(0)
            same.append(storage)
            self.reused += 1
            return torch.empty(0, dtype=torch.uint8).set_(storage)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        same.append(buf.untyped_storage())
        self.allocated += 1
        return buf

    def trim(self) -> None:
        """After an update ends: keep, of each size, as many free buffers as the update took of it (the
        next one's spares), first in their size's line so take() finds them; buffers still held stay,
        behind them. By size, not by bytes: a dense deploy's one large bucket, free and first in line,
        would otherwise use up the budget of every sparse update after it, whose tensors then come from
        fresh memory each sync."""
        kept = {}
        for size, same in self._kept.items():
            spares = self._taken.get(size, 0)
            free, held = [], []
            for storage in same:
                if not _free(storage):
                    held.append(storage)
                elif len(free) < spares:
                    free.append(storage)
            if free or held:
                kept[size] = free + held
        self._kept, self._taken = kept, {}

    def clear(self) -> None:
        self._kept, self._taken = {}, {}

    @property
    def kept_bytes(self) -> int:
        return sum(size * len(same) for size, same in self._kept.items())
