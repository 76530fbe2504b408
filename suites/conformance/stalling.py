"""An engine factory whose commit never returns: a rank that hangs, for the supervision tests."""

import threading

from harness.engines.reference import ReferenceEngine


class StallingEngine(ReferenceEngine):
    def commit_weights(self, tensors, version):
        threading.Event().wait()  # hangs here; the supervisor must notice and dump this stack


def make_stalling_engine(spec=None, device=None):
    return StallingEngine(extra=spec, device=device)
