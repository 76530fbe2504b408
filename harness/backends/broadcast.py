"""Built-in backend `broadcast`: the broadcast path (harness.paths.broadcast) deployed as rank 0 in the
trainer and a receiver per rank process, over gloo (CPU) or NCCL (the GPU variant)."""

from __future__ import annotations

from harness.api import DEFAULT_TIMEOUT_S, Capabilities, DeployRequest
from harness.backends import RankBackend
from harness.paths.broadcast import BroadcastSender


class BroadcastBackend(RankBackend):
    """Built-in backend `broadcast`: rank 0 in this process, receivers in spawned rank processes."""

    name = "broadcast"
    sender_cls = BroadcastSender
    soak = True
    receiver_path = control_receiver = "harness.paths.broadcast:BroadcastReceiver"
    rank_in_init_info = True  # a process group: each rank joins as itself

    def __init__(
        self, backend: str = "gloo", bucket_bytes: int = 1 << 20, timeout_s: float = DEFAULT_TIMEOUT_S
    ):
        self.backend = backend
        self.ceiling = backend  # a bare broadcast of the same bucket plan over the same library
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.capabilities = Capabilities(
            multi_receiver=True, max_receivers=16, gpu=backend == "nccl", interposable=True, buckets=True
        )

    def make_sender(self, request: DeployRequest, addr: str | None = None) -> BroadcastSender:
        """`addr`: the trainer's address as the ranks see it (ranks placed elsewhere, e.g. containers)."""
        return self.sender_cls(
            request.n_receivers, self.backend, request.unit(self.bucket_bytes), self.timeout_s, addr=addr
        )


def make_backend() -> BroadcastBackend:
    return BroadcastBackend()


def make_nccl_backend(device: str = "cuda") -> BroadcastBackend:
    """The same path over NCCL: rank r on GPU r (the GPU variant; needs 1 + receivers GPUs)."""
    return BroadcastBackend(backend="nccl", bucket_bytes=64 << 20)
