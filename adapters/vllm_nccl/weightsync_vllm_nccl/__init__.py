"""weightsync_vllm_nccl: vLLM's own `nccl` weight transfer (its trainer and engine sides, unmodified) as a
weightsync backend. `weightsync certify --backend weightsync_vllm_nccl:make_backend`; see the package's README."""

from weightsync_vllm_nccl.backend import NcclInitError, VllmNcclBackend, make_backend

__all__ = ["NcclInitError", "VllmNcclBackend", "make_backend"]
