"""The launch settings both vLLM forms share: one set of options, rendered as `LLM(...)` keyword
arguments for the in-process engine (harness.engines.vllm) and as the dev-mode server's command line
(harness.engines.vllm_server), so the two forms serve the same model the same way.

Both load the harness's weight-transfer backend into vLLM through `worker_extension_cls`
(harness.engines.vllm_transport, which cannot be imported without vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from harness.engines.vllm_constants import BACKEND, EXTENSION

DEFAULT_KV_CACHE_BYTES = 64 << 20  # vLLM on CPU otherwise sizes its KV cache from a share of all RAM


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """What a vLLM form is started with (the model directory aside)."""

    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 8
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    seed: int = 0
    #: vLLM's weight-transfer engine: the harness's own file transport, or one of vLLM's (an adapter's "nccl")
    weight_transfer: str = BACKEND
    #: vLLM's tensor-parallel ranks; above 1 each is a worker process of vLLM's "mp" executor
    tensor_parallel_size: int = 1

    def llm_kwargs(self, model_dir: str | os.PathLike) -> dict[str, Any]:
        """Keyword arguments of vLLM's `LLM` (the in-process form; one process, uni executor)."""
        return {
            "model": str(model_dir),
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "seed": self.seed,
            "kv_cache_memory_bytes": self.kv_cache_bytes,
            "distributed_executor_backend": "uni" if self.tensor_parallel_size == 1 else "mp",
            "tensor_parallel_size": self.tensor_parallel_size,
            "worker_extension_cls": EXTENSION,
            "weight_transfer_config": {"backend": self.weight_transfer},
        }

    def server_args(self, model_dir: str | os.PathLike) -> list[str]:
        """The same options on the command line of vLLM's OpenAI-compatible server."""
        return [
            "--model", str(model_dir),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--seed", str(self.seed),
            "--worker-extension-cls", EXTENSION,
            "--weight-transfer-config", json.dumps({"backend": self.weight_transfer}),
        ] + (["--tensor-parallel-size", str(self.tensor_parallel_size)] if self.tensor_parallel_size > 1 else [])  # fmt: skip


def cpu_thread_binding(tensor_parallel_size: int) -> str:
    """A value for VLLM_CPU_OMP_THREADS_BIND giving each TP worker its own share of this process's CPUs.

    vLLM's default ("auto") binds one NUMA node per worker and refuses more workers than nodes
    (vllm/utils/ompmultiprocessing.py, _get_autobind_cpu_ids: "Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers"); a one-node machine runs TP > 1 only with the CPUs listed by hand."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel_size:
        return "nobind"
    shares = [cpus[i::tensor_parallel_size] for i in range(tensor_parallel_size)]
    return "|".join(",".join(map(str, sorted(share))) for share in shares)


def private_tmpdir(base: str | os.PathLike | None = None) -> Path:
    """A private TMPDIR for vLLM's rendezvous files, made current for this process."""
    path = Path(tempfile.mkdtemp(prefix="weightsync-vllm-", dir=base))
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # re-read TMPDIR
    return path
