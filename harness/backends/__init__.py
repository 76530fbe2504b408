"""The built-in backends: each path of harness/paths/ wired into a deployment (the trainer's sender
and a receiver per rank process). The factories here are what harness.registry names."""

from __future__ import annotations

from harness.api import JSON, Sender, WeightSpec
from harness.launch import RankDeployment


def _same_init_info(info: JSON, rank: int) -> JSON:
    return info


def _init_info_with_rank(info: JSON, rank: int) -> JSON:
    return {**info, "rank": rank}


def rank_deployment(
    sender: Sender,
    receiver_path: str,
    n_receivers: int,
    spec: WeightSpec | None,
    workdir: str,
    engine: str | None,
    timeout_s: float,
    *,
    rank_in_init_info: bool = False,
    deployment_cls: type[RankDeployment] = RankDeployment,
    **extra,
) -> RankDeployment:
    """A backend's `deploy`: `sender` in the trainer and `n_receivers` rank processes, each a receiver
    (`receiver_path`, `pkg.module:Class`) with an engine, supervised with `timeout_s`. Every rank gets
    the sender's init info, with its own rank number added where `rank_in_init_info` (a process group:
    broadcast and delta over it). `deployment_cls` places the ranks elsewhere (e.g. containers; `extra`
    goes to it)."""
    return deployment_cls(
        sender=sender,
        receiver_path=receiver_path,
        n_receivers=n_receivers,
        spec=spec,
        engine=engine,
        workdir=workdir,
        rank_init_info=_init_info_with_rank if rank_in_init_info else _same_init_info,
        timeout=timeout_s,
        **extra,
    )
