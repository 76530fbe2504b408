"""Built-in backend `disk`: the disk path (harness.paths.disk) deployed as one writer in the trainer and
a reader per rank process."""

from __future__ import annotations

from pathlib import Path

from harness.api import DEFAULT_TIMEOUT_S, Capabilities, DeployRequest
from harness.backends import RankBackend
from harness.paths.disk import DEFAULT_SHARD_BYTES, DiskSender


class DiskBackend(RankBackend):
    """Built-in backend `disk`: one writer, N readers of a directory, each reader a rank process (a
    read blocked on a hung filesystem holds only its rank, which the supervisor can kill)."""

    name = "disk"
    ceiling = "disk"
    soak = True
    receiver_path = control_receiver = "harness.paths.disk:DiskReceiver"
    capabilities = Capabilities(multi_receiver=True, max_receivers=8, interposable=True, buckets=True)

    def __init__(self, shard_bytes: int = DEFAULT_SHARD_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.shard_bytes = shard_bytes
        self.timeout_s = timeout_s

    @property
    def bucket_bytes(self) -> int:  # a shard file is this path's bucket
        return self.shard_bytes

    def make_sender(self, request: DeployRequest) -> DiskSender:
        return DiskSender(Path(request.workdir) / "checkpoints", request.unit(self.shard_bytes))


def make_backend() -> DiskBackend:
    return DiskBackend()
