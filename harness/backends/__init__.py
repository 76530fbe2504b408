"""The built-in backends: each path of harness/paths/ wired into a deployment (the trainer's sender
and a receiver per rank process). The factories here are what harness.registry names."""

from __future__ import annotations

import abc
from typing import Any

from harness.api import DEFAULT_TIMEOUT_S, JSON, Backend, Deployment, DeployRequest, Sender
from harness.launch import RankDeployment


def _same_init_info(info: JSON, rank: int) -> JSON:
    return info


def _init_info_with_rank(info: JSON, rank: int) -> JSON:
    return {**info, "rank": rank}


class RankBackend(Backend):
    """A backend whose receivers run in supervised rank processes (harness.launch), one per engine: it
    makes its sender and names its receiver; the deployment is wired here, once for every such path.

    Every rank gets the sender's init info, with its own rank number added where `rank_in_init_info` (a
    process group: broadcast, and delta over it); ranks are supervised with `timeout_s`."""

    #: the receiver each rank runs, `pkg.module:Class` (imported again in the rank process)
    receiver_path: str
    rank_in_init_info: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    @abc.abstractmethod
    def make_sender(self, request: DeployRequest, **sender_options: Any) -> Sender:
        """The trainer's side of the path for `request` (`sender_options`: what `build_with` was given
        for it, e.g. the address the ranks reach the trainer at)."""

    def build(self, request: DeployRequest) -> Deployment:
        return self.build_with(RankDeployment, request)

    def build_with(
        self,
        deployment_cls: type[RankDeployment],
        request: DeployRequest,
        sender_options: dict[str, Any] | None = None,
        **placement: Any,
    ) -> RankDeployment:
        """This path's deployment with its ranks placed by `deployment_cls` (e.g. in containers; `placement`
        goes to it) and `sender_options` to `make_sender`."""
        return deployment_cls(
            sender=self.make_sender(request, **(sender_options or {})),
            receiver_path=self.receiver_path,
            n_receivers=request.n_receivers,
            spec=request.spec,
            engine=request.engine,
            workdir=request.workdir,
            rank_init_info=_init_info_with_rank if self.rank_in_init_info else _same_init_info,
            timeout=self.timeout_s,
            **placement,
        )
