"""weightsync_checkpoint_engine: MoonshotAI checkpoint-engine's colocated weight update (ParameterServer.update ->
checkpoint_engine.worker.update_weights_from_ipc: CUDA IPC buckets, ZMQ) as a weightsync backend, its code
unmodified. `weightsync certify --backend weightsync_checkpoint_engine:make_backend --device cuda`; see the
package's README. Importing this package does not import checkpoint-engine (a host without it or without a GPU
gets a BackendError at deploy, naming what is missing)."""

from weightsync_checkpoint_engine.backend import (
    CheckpointEngineBackend,
    CheckpointEngineReceiver,
    CheckpointEngineSender,
    make_backend,
)

__all__ = ["CheckpointEngineBackend", "CheckpointEngineReceiver", "CheckpointEngineSender", "make_backend"]
