"""Built-in backend `disk`: the disk path (harness.paths.disk) deployed as one writer in the trainer and
a reader per rank process."""

from __future__ import annotations

from pathlib import Path

from harness.api import DEFAULT_TIMEOUT_S, Backend, Capabilities, WeightSpec
from harness.backends import rank_deployment
from harness.paths.disk import DEFAULT_SHARD_BYTES, DiskSender


class DiskBackend(Backend):
    """Built-in backend `disk`: one writer, N readers of a directory, each reader a rank process (a
    read blocked on a hung filesystem holds only its rank, which the supervisor can kill)."""

    name = "disk"
    ceiling = "disk"
    soak = True
    control_receiver = "harness.paths.disk:DiskReceiver"
    capabilities = Capabilities(multi_receiver=True, max_receivers=8, interposable=True, buckets=True)

    def __init__(self, shard_bytes: int = DEFAULT_SHARD_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.shard_bytes = shard_bytes
        self.timeout_s = timeout_s

    @property
    def bucket_bytes(self) -> int:  # a shard file is this path's bucket
        return self.shard_bytes

    def deploy(
        self,
        n_receivers: int,
        spec: WeightSpec | None,
        workdir: str,
        engine: str | None = None,
        bucket_bytes: int | None = None,
    ):
        return rank_deployment(
            DiskSender(Path(workdir) / "checkpoints", bucket_bytes or self.shard_bytes),
            "harness.paths.disk:DiskReceiver",
            n_receivers,
            spec,
            workdir,
            engine,
            self.timeout_s,
        )


def make_backend() -> DiskBackend:
    return DiskBackend()
