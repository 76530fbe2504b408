"""Every fault kind the matrix runs, by name, each a `Fault` of one shape: the in-push kinds and the
trainer's own death (`injectors.py`) and the damage done between syncs (`between.py`), in one table that
imports both (so neither imports the other's table), and the network's faults between hosts (`network.py`). Each kind declares its points, what it applies to,
its family (which cell runs it: harness.faults.matrix) and whether it is a fault of the control plane."""

from __future__ import annotations

from harness.faults import between, network
from harness.faults.injectors import (
    BlockedRead,
    CommitFail,
    Fault,
    HttpAnswerLost,
    HttpRequestCut,
    PayloadCorrupt,
    PayloadCut,
    ReceiverKill,
    ReceiverStall,
    StorageFull,
    TrainerKill,
    TrainerRaise,
    TrainerRankKill,
    TrainerRankStall,
)

FAULTS: dict[str, type[Fault]] = {
    f.kind: f
    for f in (
        ReceiverKill,
        ReceiverStall,
        TrainerRaise,
        PayloadCorrupt,
        PayloadCut,
        BlockedRead,
        CommitFail,
        StorageFull,
        HttpRequestCut,
        HttpAnswerLost,
        *between.KINDS,
        TrainerKill,
        TrainerRankKill,
        TrainerRankStall,
        *network.KINDS,
    )
}

#: The kinds that are faults of the control plane itself (the control column of the default selection).
CONTROL_PLANE_KINDS: tuple[str, ...] = tuple(k for k, f in FAULTS.items() if f.control_plane)
#: The kinds whose ranks run on other hosts (containers): the Docker tier runs them, not the default selection.
NETWORK_KINDS: tuple[str, ...] = tuple(k for k, f in FAULTS.items() if f.family == network.NETWORK)
