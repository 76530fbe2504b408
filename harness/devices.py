"""Where engines and payloads live: the device a run names (`weightsync ... --device cuda:0`,
`--weightsync-device`), carried to every process of the run by one environment variable.

An environment variable, because the processes that build engines are many and not all ours: rank
processes spawned by a deployment, fault cells' wrapped engines, torchrun workers. Each inherits it, and
registry.make_engine hands it to every engine factory that takes a `device` argument.
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "WEIGHTSYNC_DEVICE"


def normalize(device: str | torch.device | None) -> str:
    """'cuda' -> 'cuda:0'; None or '' -> 'cpu'; anything torch cannot parse is a ValueError."""
    if device is None or device == "":
        return "cpu"
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r}: {exc}") from None
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", 0)
    return str(d)


def run_device() -> str:
    """The device this run names ('cpu' where none is named)."""
    return normalize(os.environ.get(DEVICE_ENV))


def set_run_device(device: str | None) -> str:
    """Name the run's device for this process and every process it starts; returns it normalized."""
    d = normalize(device)
    if d == "cpu":
        os.environ.pop(DEVICE_ENV, None)
    else:
        os.environ[DEVICE_ENV] = d
    return d


def check_available(device: str) -> None:
    """A usage error, before anything runs, when the device is not there."""
    d = torch.device(device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device}: CUDA is not available here (torch {torch.__version__})")
        if (d.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
