"""Every fault kind the matrix runs, by name: the in-push kinds (`injectors.py`) and the damage done between
syncs (`between.py`), in one table that imports both (so neither imports the other's table)."""

from __future__ import annotations

from harness.faults import between
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
    TrainerRaise,
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
    )
}
