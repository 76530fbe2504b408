"""Real vLLM as the control server under test: the factory `start` that
`--weightsync-control-server suites.vllm.control_target:start` calls once per test (harness/control/under_test.py).

A dev-mode vLLM server (`harness.engines.vllm_server.VllmServerProcess`, the tiny Llama in float32)
with the harness's file transport registered in vLLM's weight-transfer factory, so the disk data plane
the control suites push with (`DiskSender`'s `{"root"}` / `{"manifest", "path"}`) is one it accepts. No
token (vLLM's dev routes have no auth). `weight_spec()` is the checkpoint's (vLLM has no `/weight_spec`);
`read_weights()` the oracle, through the transport's worker extension (`/collective_rpc weightsync_read`),
not through the sync path.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import safetensors.torch
import torch

from harness.api import TensorSpec

CONTEXT = 256
_reads = itertools.count()


class VllmControlServer:
    def __init__(self, workdir: Path):
        from harness.engines.tiny_hf_models import TINY_LLAMA, build
        from harness.engines.vllm_server import VllmServerProcess

        self.workdir = Path(workdir)
        cache = Path(os.environ.get("WEIGHTSYNC_MODEL_CACHE") or self.workdir.parent / "models")
        self.model_dir = build(dataclasses.replace(TINY_LLAMA, max_position_embeddings=CONTEXT), cache)
        self.data_dir = self.workdir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # vLLM's ZMQ sockets live under the server's workdir, and a socket path has 107 characters at most:
        # a test's tmp_path is too deep for it, so the server's own files go to a short /tmp folder (not
        # $TMPDIR: the vLLM tier points it at a deep private folder)
        self._server_dir = Path(tempfile.mkdtemp(prefix="ws-vllm-", dir="/tmp"))
        self.process = VllmServerProcess(self.model_dir, self._server_dir, max_model_len=CONTEXT)
        self.process.start()
        self.url = self.process.url
        self.token = None
        base = safetensors.torch.load_file(str(self.model_dir / "model.safetensors"))
        self._spec = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in base.items()}

    def weight_spec(self) -> dict[str, TensorSpec]:
        return dict(self._spec)

    def read_weights(self) -> dict[str, torch.Tensor]:
        path = self.workdir / f"readback-{next(_reads)}.safetensors"
        resp = httpx.post(
            self.url + "/collective_rpc",
            json={"method": "weightsync_read", "kwargs": {"path": str(path)}},
            timeout=300,
        )
        assert resp.status_code == 200, resp.text[:300]
        return safetensors.torch.load_file(str(path))

    def close(self) -> None:
        try:
            self.process.stop()
        finally:
            shutil.rmtree(self._server_dir, ignore_errors=True)


def start(workdir: Path) -> VllmControlServer:
    return VllmControlServer(workdir)
