"""The HTTP control plane as a path: vLLM's RL routes (/start_weight_update, /update_weights,
/finish_weight_update...) drive every engine's lifecycle over HTTP while the tensors move on the disk
data plane. Each engine and its control server live in a rank process, so a server can be killed or
frozen like any rank; the oracle reads weights over the rank's pipe, never over HTTP.

A call that gets no answer in time is the supervisor's business, as for a pipe-driven rank: the rank is
killed (stacks dumped first) and the next push restarts it.
"""

from __future__ import annotations

import inspect
import os
import secrets
import signal
from pathlib import Path

import httpx

from harness.api import (
    DEFAULT_TIMEOUT_S,
    Backend,
    Capabilities,
    DeployRequest,
    EngineHandle,
    RankFailure,
    Receiver,
    TransferError,
    WeightSpec,
)
from harness.control.client import ControlClient, Timeouts
from harness.control.remote import RemoteEngine as HttpEngine
from harness.control.remote import RemoteReceiver as HttpReceiver
from harness.launch import RankDeployment, RankProcess
from harness.launch.pipe_proxies import PipeEngine
from harness.paths.disk import DiskSender
from harness.ranks import protocol


def _supervised_phase(name: str):
    """`name` of the HTTP receiver, under `_supervised`: a real method with the Receiver's signature."""
    api = getattr(Receiver, name)

    def phase(self, *args, **kwargs):
        return self._supervised(getattr(HttpReceiver, name).__get__(self), *args, **kwargs)

    phase.__name__, phase.__qualname__ = name, f"SupervisedHttpReceiver.{name}"
    phase.__doc__ = f"{name} over HTTP, supervised."
    phase.__signature__ = inspect.signature(api)
    return phase


def _supervise_phases(cls: type) -> type:
    """Every receiver operation of the rank protocol's table, supervised (none is copied by hand)."""
    for op in protocol.OPS.values():
        if op.target == "receiver":
            setattr(cls, op.method, _supervised_phase(op.method))
    return cls


@_supervise_phases
class SupervisedHttpReceiver(HttpReceiver):
    """The four phases over HTTP; an error names the rank, and a call that got no answer in time has
    its rank killed (it may be frozen or blocked in a read: only a restart frees it). Each phase is a
    receiver operation of the rank protocol's table (harness.ranks.protocol), wrapped by _supervise_phases."""

    def __init__(self, client: ControlClient, rank: RankProcess):
        super().__init__(client)
        self.rank = rank

    def _supervised(self, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except TransferError as exc:  # no answer, or no connection: the server cannot be trusted now
            died = not self.rank.process.is_alive()
            self._kill(str(exc).splitlines()[0])
            where = f"rank {self.rank.rank} (pid {self.rank.pid}, {self.client.base_url})"
            if not (died or isinstance(exc.__cause__, httpx.TransportError)):  # it answered with an error
                exc.add_note(f"receiver: {where} killed; log tail:\n{self.rank.log_tail(10)}")
                raise
            # Dead, or killed for giving no answer in time: a RankFailure, as over a pipe (push() then
            # restarts a rank found dead at start once, instead of failing a sync that never began).
            what = (
                "had died"
                if died
                else f"gave no reply to {call.__name__} over HTTP in time (killed; stacks in its log)"
            )
            raise RankFailure(f"{where} {what}: {exc}\nlog tail:\n{self.rank.log_tail(10)}") from exc
        except Exception as exc:
            exc.add_note(f"receiver: rank {self.rank.rank} ({self.client.base_url})")
            raise

    def _kill(self, why: str) -> None:
        if self.rank.process.is_alive():
            try:
                os.kill(self.rank.pid, signal.SIGUSR1)  # faulthandler: the stacks go to its log
            except ProcessLookupError:
                pass
            self.rank.process.join(0.25)
            self.rank.process.kill()
            self.rank.process.join(5.0)
        self.rank._broken = f"no answer over HTTP ({why})"


class ControlDeployment(RankDeployment):
    """Disk sender in the trainer; per rank an engine, a DiskReceiver and a control server."""

    def __init__(
        self, n_receivers: int, spec: WeightSpec | None, workdir: str, engine: str | None, timeout_s: float
    ):
        self._token = secrets.token_urlsafe(24)
        self._root = Path(workdir) / "checkpoints"
        # half the timeout per call, and a call that timed out is not repeated (the server is frozen or
        # blocked: the supervisor kills it): a finish whose answer timed out also asks /weight_status, and
        # the failed push then aborts everywhere; all of it must fit in 2x the timeout. A connection cut
        # or an answer lost is repeated once, with the same Idempotency-Key: the server replays it.
        self._timeouts = Timeouts(
            connect=timeout_s / 2,
            control=timeout_s / 2,
            update=timeout_s / 2,
            write=timeout_s / 2,
            pause=timeout_s,
            stream_idle=timeout_s,
        )
        self._clients: list[ControlClient] = []
        super().__init__(
            DiskSender(self._root),
            "harness.paths.disk:DiskReceiver",
            n_receivers,
            spec,
            engine,
            workdir,
            lambda info, rank: info,
            timeout_s,
        )

    def _handle_for(self, rank: RankProcess) -> EngineHandle:
        url = protocol.call(rank, "serve_control", token=self._token, allowed_dirs=[str(self._root)])
        client = ControlClient(
            url, token=self._token, timeouts=self._timeouts, retries=1, retry_timeouts=False
        )
        self._clients.append(client)
        return EngineHandle(SupervisedHttpReceiver(client, rank), HttpEngine(client, direct=PipeEngine(rank)))

    def reset(self, spec: WeightSpec | None = None) -> None:
        """Fresh engines: every rank is restarted (a server holds its engine for its lifetime)."""
        self._spec = spec
        for r in self.ranks:
            r._broken = "reset: replaced by a fresh rank"
        self._restart_unhealthy()
        self.sender.reset()
        self.connect()

    def close(self) -> None:
        for c in self._clients:
            c.close()
        super().close()


class ControlBackend(Backend):
    """Built-in backend `control`: the HTTP control plane (vLLM's RL routes) over the disk data plane."""

    name = "control"
    capabilities = Capabilities(multi_receiver=True, max_receivers=8, interposable=True, http_control=True)

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s

    def build(self, request: DeployRequest) -> ControlDeployment:
        return ControlDeployment(
            request.n_receivers, request.spec, request.workdir, request.engine, self.timeout_s
        )


def make_backend() -> ControlBackend:
    return ControlBackend()
