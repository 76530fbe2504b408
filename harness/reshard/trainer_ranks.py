"""The trainer's N FSDP ranks of a resharded sync as processes: warm forks (harness.warm), each holding
only its Shard(0) rows of every tensor, sending its planned transfers over the sync's world.

A rank is told, per version, where the trainer's full tensors lie (a file in /dev/shm that the sender
wrote, `harness.reshard.path`); it maps it, takes its own rows (`layout.chunk_rows`, what `Shard(0)` holds)
and sends what the plan asks of it (`sync.send_shards`). Commands and replies travel over a pipe per rank;
errors come back through `error_codec`. Every wait is bounded: a rank that dies is named with how it ended,
one that does not answer in time with its kernel state, and either is replaced before the next sync."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness import error_codec, warm
from harness.api import RankFailure, RankInfo, TransferError
from harness.paths.ipc import sweep_abandoned_segments
from harness.procs import describe_exit, process_state
from harness.reshard import ipc_plane
from harness.reshard.collective import join_world, rank_device
from harness.reshard.gpu_bench import views
from harness.reshard.layout import DTYPES, ModelShape, chunk_rows
from harness.reshard.plan import plan_for_names
from harness.reshard.sync import (
    BROADCAST,
    IPC,
    P2P,
    broadcast_shards,
    check_local_shards,
    join_broadcast_groups,
    send_shards,
)

JOIN, SEND, PING, STOP = "join", "send", "ping", "stop"
#: How long a rank waits for its next command: a trainer that went away closes the pipe first
IDLE_S = 3600.0


def local_shards(full: Mapping[str, torch.Tensor], n: int, rank: int) -> dict[str, torch.Tensor]:
    """Trainer `rank`'s Shard(0) rows of each tensor (views: nothing else of the tensor is read)."""
    out = {}
    for name, t in full.items():
        lo, hi = chunk_rows(t.shape[0], n, rank) if t.dim() else (0, 0)
        out[name] = t[lo:hi]
    return out


class _Rank:
    """Trainer rank `rank`'s side: its world, its plans."""

    def __init__(self, rank: int):
        self.rank = rank
        self.world: dist.ProcessGroup | None = None
        self.broken: list[dist.ProcessGroup] = []  # a failed gloo group is kept: its teardown may block
        self.plans: dict[tuple, Any] = {}
        self.opened = ipc_plane.OpenedBuffers()  # the trainer's staging buffer, mapped
        self.plane = P2P  # the world's data plane; on the broadcast plane, this rank's groups
        self.groups: dict[tuple[int, int], Any] = {}
        self.store: dist.Store | None = None  # the world's store, where the ipc plane names its buffers
        self.buffer: ipc_plane.TrainerShardBuffer | None = None  # the ipc plane's: this rank's shards
        self.wire = torch.device("cpu")  # where its messages lie for the world's collective

    def join(self, w: dict) -> None:
        if self.world is not None:
            self.broken.append(self.world)
        # its wire: where its messages lie (host memory for gloo)
        store, self.world, self.wire = join_world(w, self.rank)
        device = rank_device(w, self.rank)  # where this rank's shards live (with NCCL, a GPU of its own)
        self.timeout_s = w["timeout_s"]  # each transfer's bound
        self.broken += [g.pg for g in self.groups.values()]
        self.plane = w.get("plane", P2P)
        self.groups = join_broadcast_groups(store, w, "trainer", self.rank) if self.plane == BROADCAST else {}
        self.store = dist.PrefixStore(f"{w['prefix']}/ipc", store)
        if device != "cpu":  # its CUDA context now, within the join's bound, not in the first sync's
            torch.empty(1, device=device)
        if self.plane == IPC and (self.buffer is None or str(self.buffer.device) != device):
            self.close()
            self.buffer = ipc_plane.TrainerShardBuffer(self.rank, device)

    def close(self) -> None:
        """Release this rank's shard buffer (its /dev/shm file)."""
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None

    def mapped(self, p: dict) -> dict[str, torch.Tensor]:
        """The version's full tensors, mapped from the trainer's staging buffer (`p["staging"]`: a /dev/shm
        file, or a device buffer by its CUDA IPC handle; the last mapping again while it is the same one)."""
        return views(self.opened.get("staging", p["staging"]), dict(p["layout"]), DTYPES[p["dtype"]])

    def send(self, p: dict) -> int:
        if self.world is None:
            raise TransferError(f"trainer rank {self.rank} has joined no resharding world")
        model = ModelShape(**p["model"])
        key = (p["engines"], tuple(sorted(p["names"])), p["planner"])
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = plan_for_names(
                model, p["trainers"], p["engines"], p["dtype"], p["names"], p["planner"]
            )
        full = self.mapped(p)
        local = local_shards({n: full[n] for n in p["names"]}, p["trainers"], self.rank)
        if self.plane == IPC:  # this rank's shards in a buffer of its own, read by the engine ranks
            check_local_shards(plan, self.rank, local)
            return ipc_plane.publish(
                self.store, p["sync"], plan, self.rank, self.buffer, local, p["replicas"], self.timeout_s
            )
        if self.plane == BROADCAST:  # each transfer once, to its engine rank on every replica
            return broadcast_shards(plan, self.rank, local, self.groups, self.wire)
        return send_shards(
            plan,
            self.rank,
            local,
            replicas=p["replicas"],
            pg=self.world,
            timeout_s=self.timeout_s,
            wire=self.wire,
        )


def rank_main(conn, rank: int) -> None:
    """A trainer rank's life: serve the trainer's commands until STOP or the pipe closes; one thread."""
    torch.set_num_threads(1)
    me = _Rank(rank)
    while True:
        if not conn.poll(IDLE_S):
            break
        try:
            op, payload = conn.recv()
        except EOFError:  # the trainer went away
            break
        if op == STOP:
            break
        try:
            result = os.getpid() if op == PING else me.join(payload) if op == JOIN else me.send(payload)
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - every error goes back to the trainer
            print(
                f"trainer rank {rank}: {op} raised {type(exc).__name__}: {exc}", file=sys.stderr, flush=True
            )
            conn.send(("error", error_codec.to_json(exc)))
    me.close()
    os._exit(0)  # tearing down gloo costs seconds; nothing is left to flush


class TrainerRanks:
    """N trainer rank processes, each a warm fork with a pipe. `call(op, payloads, timeout_s)` sends each
    rank its payload and waits for every reply, bounded; a rank that died or did not answer is named."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list = [None] * n
        self.conns: list = [None] * n
        self.unanswered: set[int] = set()  # ranks that did not answer a call in time: replaced by restart
        try:
            for r in range(n):
                self._start(r)
        except BaseException:
            self.close()
            raise

    def _start(self, r: int) -> None:
        ctx = warm.context()
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=warm.inherit,
            args=(warm.here(), rank_main, child, r),
            daemon=True,
            name=f"trainer-rank-{r}",
        )
        p.start()
        child.close()
        self.procs[r], self.conns[r] = p, parent
        self.unanswered.discard(r)

    def processes(self) -> list[RankInfo]:
        return [RankInfo(f"trainer rank {r}", p.pid) for r, p in enumerate(self.procs) if p is not None]

    def alive(self, r: int) -> bool:
        return self.procs[r] is not None and self.procs[r].exitcode is None

    def healthy(self) -> bool:
        return not self.unanswered and all(p is not None and p.exitcode is None for p in self.procs)

    def answering(self, timeout_s: float) -> bool:
        """Every rank answers a ping within `timeout_s` (a rank SIGKILLed a moment ago may not have exited
        yet: its exit code does not show, its silence does); one that does not is marked for restart."""
        if not self.healthy():
            return False
        try:
            self.call(PING, [None] * self.n, timeout_s)
        except Exception:  # noqa: BLE001 - which rank, and how, is what restart_unhealthy acts on
            return False
        return True

    def restart_unhealthy(self) -> list[int]:
        """Replace every rank that died or did not answer in time; the ranks replaced."""
        bad = [
            r for r, p in enumerate(self.procs) if p is None or p.exitcode is not None or r in self.unanswered
        ]
        for r in bad:
            self._kill(r)
            self._start(r)
        return bad

    def describe(self, r: int) -> str:
        p = self.procs[r]
        if p.exitcode is not None:
            return f"trainer rank {r} (pid {p.pid}) {describe_exit(p.exitcode)}"
        return f"trainer rank {r} (pid {p.pid}) alive, state {process_state(p.pid)}"

    def call(self, op: str, payloads: Sequence[Any], timeout_s: float) -> list[Any]:
        """`op` to every rank (rank r gets payloads[r]); their results. Raises, once every rank has answered
        or `timeout_s` passed, the first rank's error (a dead or silent rank before an error it reported)."""
        for r, payload in enumerate(payloads):
            try:
                self.conns[r].send((op, payload))
            except (OSError, ValueError):  # its pipe is closed: it died; named below
                pass
        deadline = time.monotonic() + timeout_s
        results: list[Any] = [None] * self.n
        failures: list[tuple[int, BaseException]] = []
        for r in range(self.n):
            try:
                results[r] = self._reply(r, deadline, timeout_s)
            except Exception as exc:  # noqa: BLE001 - ranked below
                failures.append((r, exc))
        if failures:
            failures.sort(key=lambda f: (not isinstance(f[1], RankFailure), f[0]))
            primary = failures[0][1]
            for r, exc in failures[1:]:
                primary.add_note(f"also, trainer rank {r}: {type(exc).__name__}: {str(exc)[:300]}")
            raise primary
        return results

    def _reply(self, r: int, deadline: float, timeout_s: float) -> Any:
        conn, p = self.conns[r], self.procs[r]
        while True:
            left = deadline - time.monotonic()
            try:
                if conn.poll(min(max(left, 0.0), 0.1)):
                    status, value = conn.recv()
                    break
            except (EOFError, OSError):
                p.join(timeout=2.0)  # a killed rank's pipe closes before it is reaped
                self.unanswered.add(r)
                raise RankFailure(f"{self.describe(r)}: its pipe closed") from None
            if p.exitcode is not None:
                raise RankFailure(self.describe(r))
            if left <= 0:
                self.unanswered.add(r)
                raise RankFailure(f"{self.describe(r)}: no answer in {timeout_s:g}s")
        if status == "error":
            raise error_codec.from_json(value, f"trainer rank {r}")
        return value

    def _kill(self, r: int) -> None:
        p = self.procs[r]
        if p is None:
            return
        if p.exitcode is None:
            p.kill()
        p.join(timeout=5)
        if p.exitcode is not None:  # a killed rank cannot release its shard file: swept by its dead pid
            sweep_abandoned_segments()
        try:
            self.conns[r].close()
        except OSError:
            pass

    def close(self) -> None:
        for r, conn in enumerate(self.conns):
            if conn is not None and self.procs[r] is not None and self.procs[r].exitcode is None:
                try:
                    conn.send((STOP, None))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            if p is not None:
                p.join(timeout=max(deadline - time.monotonic(), 0))
        for r in range(self.n):
            self._kill(r)
