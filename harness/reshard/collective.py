"""Which collective a resharding world's messages travel on, and where each of its ranks keeps its shards.

- **gloo**: every rank on the host (the CPU variant). Its messages carry host memory.
- **NCCL**: a GPU per rank (each trainer rank and each engine rank of every replica on a GPU of its own):
  the p2p and broadcast planes move each transfer device to device, with no host hop.
- Ranks that share one GPU use neither for their bytes: they read each other's buffers (the ipc plane),
  and gloo carries only the world's formation.

The world's description says which (`world["collective"]`, and `world["devices"]`, one device per world
rank), so every rank forms its groups and lands its bytes as the world says. The gloo variant goes through
the same functions (`new_group`, `wire_device`), which is how CI exercises the NCCL variant's code path
on a host without GPUs."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from harness.api import BackendError

GLOO, NCCL = "gloo", "nccl"
COLLECTIVES = (GLOO, NCCL)


def gpu_count(device: str) -> int:
    """The GPUs a world on `device` may spread over (none on the host)."""
    return torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0


def placement(world_size: int, device: str, gpus: int) -> tuple[str, list[str]]:
    """(collective, the device of each of `world_size` world ranks) for a world on `device` on a host
    with `gpus` GPUs: on the host, gloo and "cpu" for every rank; with a GPU per rank, NCCL and rank i on
    GPU i; with fewer GPUs than ranks, every rank on `device` (the ipc plane), gloo for the rest."""
    if device == "cpu":
        return GLOO, ["cpu"] * world_size
    if gpus >= world_size:
        return NCCL, [f"cuda:{i}" for i in range(world_size)]
    return GLOO, [device] * world_size


def rank_device(world: Mapping, world_rank: int) -> str:
    """Where world rank `world_rank` keeps its shards (`world["devices"]`, else the world's one device)."""
    devices = world.get("devices")
    return devices[world_rank] if devices else world.get("device", "cpu")


def wire_device(world: Mapping, world_rank: int) -> torch.device:
    """Where this rank's messages must lie for its collective: host memory for gloo, its GPU for NCCL."""
    if world.get("collective", GLOO) == NCCL:
        return torch.device(rank_device(world, world_rank))
    return torch.device("cpu")


def join_world(w: Mapping, world_rank: int) -> tuple[dist.Store, dist.ProcessGroup, torch.device]:
    """World rank `world_rank` joins the resharding world `w` (its store at `w["port"]`, under
    `w["prefix"]`, given `w["join_s"]` to form, on `w["collective"]`): (its client of the world's store,
    its group, its wire device). What a trainer rank and an engine rank both do to join."""
    join = datetime.timedelta(seconds=w["join_s"])  # forming the world: every rank connects to every rank
    store = dist.TCPStore("127.0.0.1", w["port"], w["size"], is_master=False, timeout=join)
    pg = new_group(
        w.get("collective", GLOO),
        dist.PrefixStore(w["prefix"], store),
        world_rank,
        w["size"],
        join,
        rank_device(w, world_rank),
    )
    return store, pg, wire_device(w, world_rank)


def new_group(
    collective: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    device: str = "cpu",
) -> dist.ProcessGroup:
    """A process group of `size` ranks over `store` (held as an object, outside torch.distributed's
    default world: a process may belong to several worlds), on `collective`; for NCCL this rank's GPU is
    `device`, made current first."""
    if collective == GLOO:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if collective != NCCL:
        raise BackendError(f"a resharding world's collective is one of {COLLECTIVES}, not {collective!r}")
    if not torch.cuda.is_available() or not str(device).startswith("cuda"):
        raise BackendError(
            f"an NCCL resharding world needs a GPU per rank; rank {rank} has {device!r} on a host with "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s)"
        )
    # a wait then blocks the calling thread, bounded by the group's timeout, and raises as gloo's does
    # (NCCL's default only orders the streams and leaves a hung peer to its watchdog)
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    torch.cuda.set_device(torch.device(device))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)
