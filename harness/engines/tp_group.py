"""The TP engine's process group: M - 1 worker rank processes beside the leader (rank 0, the process
that holds the engine), one gloo group over a TCPStore the leader hosts, and the leader's commands to
the ranks as broadcasts over it.

Every wait is bounded: starting by `start_within_s` (each worker says it is up through the store before
the group is built, so a worker that dies while importing is named, not waited on); every collective by
the group's timeout; a worker's wait for the next command by `idle_s` (a leader that exits closes its
sockets and the worker's wait ends at once)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from harness import warm
from harness.procs import describe_exit, pid_alive, process_state

READY_KEY = "ranks-up"
#: each worker rank adds 1 once its rank is built (its shards on its device) and it waits for commands
BUILT_KEY = "ranks-built"


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """What a rank needs to join the group."""

    rank: int
    size: int
    port: int
    prefix: str
    timeout_s: float


def client_store(info: GroupInfo) -> dist.Store:
    """A worker's connection to the leader's store."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    return dist.TCPStore("127.0.0.1", info.port, info.size, is_master=False, timeout=timeout)


def join(info: GroupInfo, store: dist.Store) -> dist.ProcessGroup:
    """This rank's gloo group, through `store` (the leader's own, or a worker's client of it)."""
    timeout = datetime.timedelta(seconds=info.timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(info.prefix, store), info.rank, info.size, timeout)


class GlooCollectives:
    """`tp_model.Collectives` over a gloo group: sums and gathers in place, each bounded by its timeout."""

    def __init__(self, pg: dist.ProcessGroup, size: int):
        self.pg, self.size = pg, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            host = t.contiguous().cpu()  # gloo sums host memory: a GPU rank's partial goes by the host
            self.pg.allreduce([host]).wait()
            t = host.to(t.device)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [t]
        host = t.contiguous().cpu()
        out = [torch.empty_like(host) for _ in range(self.size)]
        self.pg.allgather([out], [host]).wait()
        return [o.to(t.device) for o in out]


def send_command(pg: dist.ProcessGroup, op: str, payload: Any) -> None:
    """The leader's command to every rank: its length, then its JSON (plain data; tensors travel apart)."""
    data = torch.frombuffer(bytearray(json.dumps([op, payload]).encode()), dtype=torch.uint8)
    pg.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0).wait()
    pg.broadcast(data, 0).wait()


def receive_command(pg: dist.ProcessGroup, idle_s: float) -> tuple[str, Any]:
    """A worker's next command: waits up to `idle_s` for the leader to send one."""
    size = torch.zeros(1, dtype=torch.int64)
    pg.broadcast(size, 0, datetime.timedelta(seconds=idle_s)).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    pg.broadcast(data, 0).wait()
    op, payload = json.loads(bytes(data.tolist()))
    return op, payload


class WorkerProcesses:
    """Ranks 1..M-1 as warm processes (forks of a server that imported torch), running `target(info,
    *args)`; the leader's store, which each marks itself up in."""

    def __init__(self, m: int, target, args: tuple, timeout_s: float, start_within_s: float, prefix: str):
        self.m = m
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            m,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=start_within_s),
        )
        self.info = GroupInfo(0, m, self.store.port, prefix, timeout_s)
        ctx = warm.context() if m > 1 else None
        self.procs = [
            ctx.Process(
                target=warm.inherit,
                args=(warm.here(), target, dataclasses.replace(self.info, rank=r), *args),
                daemon=True,
                name=f"tp-rank-{r}",
            )
            for r in range(1, m)
        ]
        for p in self.procs:
            p.start()
        self._wait_up(start_within_s)

    def _wait_up(self, within_s: float) -> None:
        self._wait_for(READY_KEY, "up", within_s)

    def wait_built(self, within_s: float) -> None:
        """Until every worker rank has built its rank and waits for commands (a GPU rank's CUDA context
        can take longer than the group's timeout, which bounds each command: the first would time out on
        a rank still building), or raise naming each rank's state after `within_s`."""
        self._wait_for(BUILT_KEY, "built", within_s)

    def _wait_for(self, key: str, what: str, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while (done := self.store.add(key, 0)) < self.m - 1:
            if time.monotonic() > deadline or any(p.exitcode is not None for p in self.procs):
                states = self.describe()
                self.close(0)
                raise RuntimeError(
                    f"TP group of {self.m}: {done} of {self.m - 1} worker ranks {what} in {within_s:g}s; {states}"
                )
            time.sleep(0.05)  # polling a counter in the store: no event to wait on across processes

    def describe(self, settle_s: float = 0.0) -> str:
        """Each worker rank's state: alive (its kernel state), or how it ended. `settle_s`: how long to give
        a rank whose socket just closed to be reaped (a killed rank's sockets close before it is)."""
        deadline = time.monotonic() + settle_s
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
        parts = []
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                parts.append(f"rank {r} (pid {p.pid}) {describe_exit(p.exitcode)}")
            else:
                parts.append(f"rank {r} (pid {p.pid}) alive, state {process_state(p.pid)}")
        return "; ".join(parts) or "no worker ranks"

    def dead(self) -> list[int]:
        return [r for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]

    def close(self, within_s: float) -> None:
        """Join every worker for up to `within_s`, then kill those left."""
        deadline = time.monotonic() + within_s
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None and pid_alive(p.pid)]
