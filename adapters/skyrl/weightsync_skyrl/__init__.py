"""weightsync_skyrl: SkyRL's delta weight sync (XOR + zstd patches in safetensors files) as a weightsync
backend. `weightsync certify --backend weightsync_skyrl:make_backend`; see the package's README."""

from weightsync_skyrl.backend import SkyrlDeltaBackend, make_backend

__all__ = ["SkyrlDeltaBackend", "make_backend"]
