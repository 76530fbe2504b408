"""Built-in backend `broadcast`: the broadcast path (harness.paths.broadcast) deployed as rank 0 in the
trainer and a receiver per rank process, over gloo (CPU) or NCCL (the GPU variant)."""

from __future__ import annotations

from harness.api import DEFAULT_TIMEOUT_S, Backend, Capabilities, WeightSpec
from harness.backends import rank_deployment
from harness.launch import RankDeployment
from harness.paths.broadcast import BroadcastSender


class BroadcastBackend(Backend):
    """Built-in backend `broadcast`: rank 0 in this process, receivers in spawned rank processes."""

    name = "broadcast"
    sender_cls = BroadcastSender
    soak = True
    control_receiver = "harness.paths.broadcast:BroadcastReceiver"

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

    def deploy(
        self,
        n_receivers: int,
        spec: WeightSpec | None,
        workdir: str,
        engine: str | None = None,
        bucket_bytes: int | None = None,
    ):
        return self.deploy_with(RankDeployment, n_receivers, spec, workdir, engine, bucket_bytes=bucket_bytes)

    def deploy_with(
        self,
        deployment_cls,
        n_receivers: int,
        spec: WeightSpec | None,
        workdir: str,
        engine: str | None = None,
        addr: str | None = None,
        bucket_bytes: int | None = None,
        **extra,
    ):
        """This path's wiring in another RankDeployment class (ranks placed elsewhere, e.g. containers),
        the sender's store at `addr` (the trainer's address as the ranks see it)."""
        return rank_deployment(
            self.sender_cls(
                n_receivers, self.backend, bucket_bytes or self.bucket_bytes, self.timeout_s, addr=addr
            ),
            "harness.paths.broadcast:BroadcastReceiver",
            n_receivers,
            spec,
            workdir,
            engine,
            self.timeout_s,
            rank_in_init_info=True,
            deployment_cls=deployment_cls,
            **extra,
        )


def make_backend() -> BroadcastBackend:
    return BroadcastBackend()


def make_nccl_backend(device: str = "cuda") -> BroadcastBackend:
    """The same path over NCCL: rank r on GPU r (the GPU variant; needs 1 + receivers GPUs)."""
    return BroadcastBackend(backend="nccl", bucket_bytes=64 << 20)
