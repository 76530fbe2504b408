"""Broken TP engine ranks (WEIGHTSYNC_TP_RANK=suites.meta.broken_tp:<Class>): the TP engine suite
(suites/conformance/test_tp_engine.py) must fail each."""

from __future__ import annotations

import torch

from harness.engines.tp_rank import TPRank


class _NoSum:
    """Collectives whose all-reduce returns this rank's own partial sum, unsummed."""

    def __init__(self, comm):
        self.comm = comm

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self.comm.all_gather(t)


class NoAllReduceRank(TPRank):
    """Skips every all-reduce (embedding, o_proj, down_proj): each rank computes on its own partial sums,
    which at TP 1 is the whole sum (the suite's TP 1 case must pass it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm = _NoSum(self.comm)


class LeaderOnlyCommitRank(TPRank):
    """Commits on rank 0 only: the other ranks vote yes and take the new version number, but keep serving
    their old shards (so every step's version gather agrees and no stamp is wrong)."""

    def install(self, version: int) -> None:
        if self.rank == 0:
            super().install(version)
        else:
            self.version = version
