"""xxh3-128 of many host tensors over the host's cores.

A sender digests every tensor before the first byte moves and a receiver verifies a bucket as it
lands; one core hashing while the others wait was on the critical path of every host sync. xxhash
releases the GIL, so threads of this process hash side by side: the tensors are split into one group
per worker, largest first onto the least loaded (a thread per tensor would cost more than a small
tensor's hash). One tensor is still hashed by one thread: xxh3 over a buffer is sequential.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

MAX_WORKERS = 8  # past a few threads, hashing is bound by memory bandwidth, not cores
MIN_PARALLEL_BYTES = 8 << 20  # below this, handing work to threads costs more than it saves

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def _executor() -> ThreadPoolExecutor:
    """One pool per process, made on first use (a forked child makes its own: threads do not fork)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_workers(), thread_name_prefix="weightsync-xxh3"))
        return _pool[1]


def groups(sizes: list[int], n: int) -> list[list[int]]:
    """Indices of `sizes` in at most `n` groups of near-equal total: largest first, each onto the group
    with the least so far. Every index appears once."""
    loads = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        g = loads.index(min(loads))
        out[g].append(k)
        loads[g] += sizes[k]
    return [g for g in out if g]


def map_hash(tensors: list[torch.Tensor], one: Callable[[torch.Tensor], str]) -> list[str]:
    """`one(t)` for every tensor, in order; spread over threads when there is enough to hash."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    workers = _workers()
    if workers < 2 or len(tensors) < 2 or sum(sizes) < MIN_PARALLEL_BYTES:
        return [one(t) for t in tensors]
    out: list[str | None] = [None] * len(tensors)

    def run(group: list[int]) -> None:
        for k in group:
            out[k] = one(tensors[k])

    for future in [_executor().submit(run, g) for g in groups(sizes, workers)]:
        future.result()  # re-raises a worker's error here
    return out  # type: ignore[return-value]
