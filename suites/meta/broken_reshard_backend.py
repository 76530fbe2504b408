"""A broken reshard backend the fault matrix must fail: its sender is deaf to a dropped trainer rank."""

from __future__ import annotations

import threading

from harness.backends.reshard import ReshardBackend, shape_from_env
from harness.reshard.trainer_ranks import TrainerRanks

#: How long the deaf sender waits on a rank that is gone before it reports success: far past any bound the
#: suites allow (2 x the cell's 4 s timeout), short enough that the run it is in can end
DEAF_S = 30.0


class DeafTrainerRanks(TrainerRanks):
    """Waits for every trainer rank's reply with no deadline of its own and never looks at its exit: a rank
    that died (its pipe closed) or stopped holds the sender as long as the wait lasts, as a send loop that
    joins its workers without a timeout does, and then it reports success."""

    def _reply(self, r, deadline, timeout_s):
        try:
            if not self.conns[r].poll(DEAF_S):
                return 0
            status, value = self.conns[r].recv()
        except (EOFError, OSError):
            threading.Event().wait(DEAF_S)  # the rank is gone: this sender never notices
            return 0
        if status == "error":
            return 0
        return value


class DeafReshardBackend(ReshardBackend):
    name = "reshard-deaf"

    def build(self, request):
        dep = super().build(request)
        dep.trainer_ranks.__class__ = DeafTrainerRanks
        dep.sender.diagnose = list  # nor does it look afterwards: no rank's death in its notes
        return dep


def make_deaf_backend() -> DeafReshardBackend:
    n, m = shape_from_env()
    return DeafReshardBackend(n, m)
