"""Built-in backend `ipc`: the shared-memory path (harness.paths.ipc) deployed with the engines in their
own processes; POSIX shared memory on CPU, CUDA IPC handles in the GPU variant."""

from __future__ import annotations

from harness.api import DEFAULT_TIMEOUT_S, Capabilities, DeployRequest
from harness.backends import RankBackend
from harness.paths.ipc import DEFAULT_BUCKET_BYTES, IpcSender


class IpcBackend(RankBackend):
    """Built-in backend `ipc`: engines in their own processes map the trainer's shared memory."""

    name = "ipc"
    soak = True
    receiver_path = "harness.paths.ipc:IpcReceiver"  # what each rank runs (a variant names its own)

    def __init__(
        self,
        device: str = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.device = device
        # same-GPU CUDA IPC: the engine's copy out of the trainer's buffer is a device-to-device copy
        self.ceiling = "memcpy" if device == "cpu" else "device-copy"
        self.bandwidth_floor = 0.03 if device == "cpu" else None
        if device == "cpu":
            self.floor_reason = (
                "the host path stages every version in fresh shared memory (page faults the copy ceiling "
                "has not): 0.08 of its verified ceiling on the 2-core VM (2026-12-04), floored at 0.03 for "
                "a loaded one"
            )
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.capabilities = Capabilities(
            ipc=True,
            multi_receiver=True,
            max_receivers=8,
            gpu=device != "cpu",
            interposable=device == "cpu",
            buckets=True,
        )

    def make_sender(self, request: DeployRequest) -> IpcSender:
        return IpcSender(self.device, request.unit(self.bucket_bytes))


def make_backend(device: str = "cpu") -> IpcBackend:
    """POSIX shared memory on the CPU; CUDA IPC handles on a GPU device."""
    return IpcBackend(device=device)


def make_cuda_backend(device: str = "cuda:0") -> IpcBackend:
    """CUDA IPC handles of buffers on one GPU (the GPU variant; needs a GPU)."""
    return IpcBackend(device=device)
