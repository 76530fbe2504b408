"""A broken reshard backend the fault matrix must fail: its sender is deaf to a dropped trainer rank."""

from __future__ import annotations

import threading

from harness.backends.reshard import ReshardBackend, shape_from_env
from harness.reshard.trainer_ranks import TrainerRanks


class DeafTrainerRanks(TrainerRanks):
    """Waits for every trainer rank's reply with no deadline and never looks at its exit: a rank that died
    (its pipe closed) or stopped leaves the sender waiting for good, as a send loop that joins its workers
    without a timeout does."""

    def _reply(self, r, deadline, timeout_s):
        try:
            status, value = self.conns[r].recv()
        except (EOFError, OSError):
            threading.Event().wait()  # the rank is gone: this sender never notices
        if status == "error":
            return 0
        return value


class DeafReshardBackend(ReshardBackend):
    name = "reshard-deaf"

    def build(self, request):
        dep = super().build(request)
        dep.trainer_ranks.__class__ = DeafTrainerRanks
        return dep


def make_deaf_backend() -> DeafReshardBackend:
    n, m = shape_from_env()
    return DeafReshardBackend(n, m)
