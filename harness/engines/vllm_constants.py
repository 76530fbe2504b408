"""vLLM's names as the harness meets them, in one place: the transport the harness registers in vLLM's
weight-transfer factory, the worker extension that registers it, the version vLLM reports before any
update, and vLLM's own lifecycle-order messages (which name no exception class). Plain values: importable
without vLLM, torch or HTTP (the control plane, the settings and the worker all read them)."""

from __future__ import annotations

#: The weight-transfer backend the harness registers (harness.engines.vllm_transport).
BACKEND = "weightsync_files"
#: vLLM imports this in every worker when `worker_extension_cls` names it, which registers BACKEND.
EXTENSION = "harness.engines.vllm_transport.WeightSyncWorkerExtension"
#: What vLLM's /weight_info (and its engine) report before any versioned finish_weight_update.
INITIAL_VERSION = "default"
#: vLLM's own lifecycle-order errors (vllm/v1/worker/gpu_worker.py), which carry no harness class name.
LIFECYCLE_MESSAGES = (
    "finish_weight_update called without a matching start_weight_update",
    "start_weight_update must be called before update_weights",
    "start_weight_update called while a weight update is already active",
    "Weight transfer not configured",
)
