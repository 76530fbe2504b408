"""A resharded sync: the plan executed over torch.distributed, from the trainer rank that owns each byte
range to the engine rank that needs it, on every engine replica (R replicas of M ranks hold the same
shards). Three data planes: point to point (each transfer sent to each replica's copy of its engine rank),
broadcast per engine rank group (each transfer one broadcast from its trainer rank to the copies of its engine
rank on every replica), and, for ranks that share one host or one GPU, ipc (each engine rank copies its slices
out of the trainer ranks' own shared buffers: `reshard.ipc_plane`); `data_plane` picks one and says why. No rank ever holds more
than its own shard (the sender packs a row-parallel column band, nothing else); every message travels as
raw bytes (uint8), so any dtype is carried bit for bit and counted exactly.

A failed message raises TransferError naming both ranks and the transfer (the process group's timeout
bounds a peer that never answers)."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from harness.api import BackendError, ManifestMismatch, TransferError
from harness.reshard.collective import GLOO, NCCL, new_group, rank_device
from harness.reshard.layout import DTYPES, REPLICATE
from harness.reshard.plan import ReshardPlan, Transfer, world_rank

#: Bytes an engine shard holds before a sync fills it: a transfer that never lands shows as 0xA5 bytes
POISON = 0xA5

P2P, BROADCAST, IPC = "p2p", "broadcast", "ipc"
DATA_PLANES = (P2P, BROADCAST, IPC)
#: the planes that carry messages over torch.distributed (the standalone worlds of harness.reshard.world)
WIRE_PLANES = (P2P, BROADCAST)


def choose_data_plane(replicas: int, device: str = "cpu", collective: str = GLOO) -> tuple[str, str]:
    """The data plane for `replicas` engine replicas whose ranks live on `device` (with a GPU each where
    `collective` is NCCL), and why (the report prints both). Every rank on one GPU: the engine ranks read
    the trainer ranks' shards through CUDA IPC handles, device to device. Otherwise by the bytes a trainer
    rank hands the collective per transfer: point to point, one send per replica; broadcast, one call for
    all of them (gloo carries them along a binomial tree, NCCL along its ring or tree)."""
    if device != "cpu" and collective != NCCL:
        return IPC, (
            f"every rank on {device}: each engine rank copies its planned slices straight out of the trainer "
            "ranks' shards through CUDA IPC handles (device to device, no host hop, no message)"
        )
    over = " over NCCL, a GPU per rank (device to device)" if collective == NCCL else ""
    if replicas > 1:
        return BROADCAST, (
            f"{replicas} replicas hold the same shards: one broadcast per transfer to the {replicas} copies of "
            f"its engine rank{over}, where point to point would send it {replicas} times"
        )
    return (
        P2P,
        f"one replica: a broadcast to one engine rank is a send, and its group one rendezvous more{over}",
    )


#: the data plane of the `reshard` backend's worlds: "auto" (choose_data_plane), "p2p", "broadcast" or "ipc"
PLANE_ENV = "WEIGHTSYNC_RESHARD_PLANE"


def data_plane(
    replicas: int, asked: str | None = None, device: str = "cpu", collective: str = GLOO
) -> tuple[str, str]:
    """The data plane a world of `replicas` engine replicas on `device` (over `collective`) uses, and
    why: `asked` (else PLANE_ENV, else "auto", which chooses)."""
    asked = asked or os.environ.get(PLANE_ENV) or "auto"
    if asked == "auto":
        return choose_data_plane(replicas, device, collective)
    if asked not in DATA_PLANES:
        raise BackendError(f"{PLANE_ENV}={asked!r}: expected auto, {', '.join(DATA_PLANES)}")
    if asked == BROADCAST and replicas < 2:
        raise BackendError(f"{PLANE_ENV}=broadcast needs 2 engine replicas or more, not {replicas}")
    if asked == IPC and device == "cpu":
        return IPC, (
            f"named by {PLANE_ENV}=ipc: each engine rank copies its planned slices out of the trainer ranks' "
            "shards in /dev/shm (every rank on this host)"
        )
    return asked, f"named by {PLANE_ENV}={asked}"


def rank_groups(n_trainers: int, n_engines: int, replicas: int) -> list[tuple[int, int, list[int]]]:
    """[(trainer rank, engine rank, world ranks of its group)]: for every (trainer rank, engine rank) pair,
    the trainer rank and that engine rank on every replica (their world ranks), in the order every rank of
    the world must create them."""
    return [
        (s, d, [s] + [world_rank(n_trainers, n_engines, "engine", d, q) for q in range(replicas)])
        for s in range(n_trainers)
        for d in range(n_engines)
    ]


class GroupBroadcast:
    """One broadcast group of the plane held as a process group object (not registered with
    torch.distributed's default world, as a process that belongs to several worlds holds its groups): the
    trainer rank is its rank 0; each broadcast's wait is bounded by `timeout_s`."""

    def __init__(self, pg: dist.ProcessGroup, timeout_s: float | None):
        self.pg, self.timeout_s = pg, timeout_s

    def post(self, buf: torch.Tensor):
        return _Bounded(self.pg.broadcast([buf], _ROOT_IS_TRAINER), self.timeout_s)


_ROOT_IS_TRAINER = dist.BroadcastOptions()
_ROOT_IS_TRAINER.rootRank = 0


def join_broadcast_groups(
    store: dist.Store, world: Mapping, role: str, rank: int, replica: int = 0
) -> dict[tuple[int, int], GroupBroadcast]:
    """The broadcast plane's groups that trainer rank `rank` (role "trainer") or engine rank `rank` of
    `replica` (role "engine") belongs to, formed over the world's `store` (the client the rank joined the
    world with; `world`: prefix, join_s, timeout_s, trainers, engines, replicas) as one process group each:
    (trainer rank, engine rank) -> its group. Every rank forms its groups in `rank_groups` order, one order
    for the whole world, so no two ranks wait on each other's next group."""
    join = datetime.timedelta(seconds=world["join_s"])
    groups = {}
    for s, d, members in rank_groups(world["trainers"], world["engines"], world["replicas"]):
        if (role == "trainer" and s != rank) or (role == "engine" and d != rank):
            continue
        prefix = dist.PrefixStore(f"{world['prefix']}/broadcast-{s}-{d}", store)
        me = 0 if role == "trainer" else 1 + replica
        pg = new_group(
            world.get("collective", GLOO), prefix, me, len(members), join, rank_device(world, members[me])
        )
        groups[(s, d)] = GroupBroadcast(pg, world["timeout_s"])
    return groups


class EngineShards:
    """The live tensor-parallel shards of one engine rank, allocated once from the plan and filled in
    place every step (padding rows zero, as vLLM's vocab loader leaves them; a tied name shares its
    tensor)."""

    def __init__(self, plan: ReshardPlan, rank: int, device: str | torch.device = "cpu"):
        self.rank = rank
        dtype = DTYPES[plan.trainer.dtype]
        self._pad = {s.name: s.pad_rows for s in plan.shards_of(rank)}
        self.tensors: dict[str, torch.Tensor] = {
            s.name: torch.empty(s.shape, dtype=dtype, device=device) for s in plan.shards_of(rank)
        }
        self.poison()
        for live, to in plan.tied().items():
            self.tensors[live] = self.tensors[to]

    def poison(self) -> None:
        """Refill every checkpoint row with POISON (between steps, so a stale byte cannot pass)."""
        for name, pad in self._pad.items():
            t = self.tensors[name]
            t.view(torch.uint8).fill_(POISON)
            if pad:
                t[t.shape[0] - pad :].view(torch.uint8).zero_()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dim() <= 1 else t.view(torch.uint8).reshape(-1)


def check_local_shards(plan: ReshardPlan, rank: int, local: Mapping[str, torch.Tensor]) -> None:
    """Raise ManifestMismatch unless trainer `rank`'s local shards have the rows the plan assumes."""
    problems = []
    for p in plan.trainer.params:
        lo, hi = plan.trainer.rows_of(p.name, rank)
        want = (hi - lo, *p.shape[1:])
        got = tuple(local[p.name].shape) if p.name in local else None
        if got != want:
            problems.append(
                f"{p.name}: plan expects local shape {want} (rows {lo}:{hi}), trainer holds {got}"
            )
    if problems:
        raise ManifestMismatch(
            f"trainer rank {rank}: local shards do not match the plan: {'; '.join(problems[:5])}"
        )


def _source_bytes(
    t: Transfer, local: Mapping[str, torch.Tensor], wire: str | torch.device = "cpu"
) -> torch.Tensor:
    """Transfer `t`'s bytes cut from the trainer rank's `local` shards, on `wire` (host memory for gloo, a
    GPU shard's bytes go through it; the rank's GPU for NCCL)."""
    rows = local[t.source][t.src_rows[0] : t.src_rows[1]]
    if t.cols is not None:
        rows = rows[:, t.cols[0] : t.cols[1]]
    data = _bytes(rows.contiguous().to(wire))
    if data.numel() != t.nbytes:  # the plan reads past the local shard: refuse, never send a short message
        raise ManifestMismatch(
            f"trainer rank {t.src}: the plan cuts {t.nbytes} B, its local shard {tuple(local[t.source].shape)} "
            f"gives {data.numel()} B: {t.describe()}"
        )
    return data


def send_shards(
    plan: ReshardPlan,
    rank: int,
    local: Mapping[str, torch.Tensor],
    batched: bool = True,
    before_send: Callable[[int], None] | None = None,
    replicas: int = 1,
    pg: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
    wire: str | torch.device = "cpu",
) -> int:
    """Send every transfer trainer `rank` owns to each of `replicas` replicas (point to point); returns the
    bytes sent. `batched`: every send posted at once, then waited for in plan order; else one after
    another, `before_send(k)` called before the k-th (k = 0, 1, ...). `pg`: the world's process group
    where it is not the default one (its ranks numbered as `plan.world_rank` numbers them), each wait on
    it bounded by `timeout_s`. `wire`: where the collective takes its messages (`collective.wire_device`)."""
    check_local_shards(plan, rank, local)
    todo = [(i, t, q) for i, t in plan.sends_of(rank) for q in range(replicas)]
    sent = 0
    if batched:
        works = [
            _post(_op("send", pg, timeout_s), _source_bytes(t, local, wire), t, i, "trainer", rank, plan, q)
            for i, t, q in todo
        ]
        return _waited([(i, t) for i, t, _ in todo], works, "trainer", rank)
    for k, (i, t, q) in enumerate(todo):
        if before_send is not None:
            before_send(k)
        _wait(
            _post(_op("send", pg, timeout_s), _source_bytes(t, local, wire), t, i, "trainer", rank, plan, q),
            t,
            i,
            "trainer",
            rank,
        )
        sent += t.nbytes
    return sent


def broadcast_shards(
    plan: ReshardPlan,
    rank: int,
    local: Mapping[str, torch.Tensor],
    groups: Mapping[tuple[int, int], object],
    wire: str | torch.device = "cpu",
) -> int:
    """Trainer `rank`'s transfers, each one broadcast to the copies of its engine rank on every replica
    (`groups[(rank, engine rank)]`, made from `rank_groups`): posted at once, waited for in plan order.
    Returns the bytes this rank put in (each transfer once, whatever the number of replicas)."""
    check_local_shards(plan, rank, local)
    todo = plan.sends_of(rank)
    works = [
        _post_broadcast(_source_bytes(t, local, wire), t, i, "trainer", rank, plan, groups) for i, t in todo
    ]
    return _waited(todo, works, "trainer", rank)


def receive_shards(
    plan: ReshardPlan,
    rank: int,
    shards: EngineShards,
    after_receive: Callable[[int], None] | None = None,
    pg: dist.ProcessGroup | None = None,
    timeout_s: float | None = None,
) -> int:
    """Receive every transfer engine `rank` needs straight into its shards (every receive posted at once,
    then waited for in plan order); returns the bytes received. `after_receive(k)` is called once k
    transfers have landed (k = 1, 2, ...). `pg`: as for `send_shards`."""
    todo = plan.receives_of(rank)
    views = _landing_views(rank, shards, todo)
    works = [
        _post(_op("recv", pg, timeout_s), view, t, i, "engine", rank, plan)
        for (i, t), view in zip(todo, views)
    ]
    return _waited(todo, works, "engine", rank, after_receive)


def receive_broadcast_shards(
    plan: ReshardPlan, rank: int, shards: EngineShards, groups: Mapping[tuple[int, int], object]
) -> int:
    """The broadcast side of engine `rank` (of any replica): every transfer it needs, received straight
    into its shards from its trainer rank's broadcast to `groups[(trainer rank, rank)]`."""
    todo = plan.receives_of(rank)
    views = _landing_views(rank, shards, todo)
    works = [_post_broadcast(view, t, i, "engine", rank, plan, groups) for (i, t), view in zip(todo, views)]
    return _waited(todo, works, "engine", rank)


def _landing_views(rank: int, shards: EngineShards, todo: list[tuple[int, Transfer]]) -> list[torch.Tensor]:
    """The bytes of engine `rank`'s shards each transfer lands in (refused if they are not its size)."""
    views = []
    for i, t in todo:
        view = _bytes(shards.tensors[t.dest][t.dst_rows[0] : t.dst_rows[1]])
        if view.numel() != t.nbytes:
            raise ManifestMismatch(
                f"engine rank {rank}: transfer #{i} carries {t.nbytes} B, its destination rows hold "
                f"{view.numel()} B: {t.describe()}"
            )
        views.append(view)
    return views


def _waited(
    todo: list[tuple[int, Transfer]], works, role: str, rank: int, after: Callable[[int], None] | None = None
) -> int:
    """Wait for each posted send or receive in plan order; the bytes moved. `after(k)` is called once k
    of them are done (k = 1, 2, ...)."""
    moved = 0
    for k, ((i, t), w) in enumerate(zip(todo, works), 1):
        _wait(w, t, i, role, rank)
        moved += t.nbytes
        if after is not None:
            after(k)
    return moved


def _op(kind: str, pg: dist.ProcessGroup | None, timeout_s: float | None = None):
    """isend / irecv on the default group, or the same on `pg` (a group held as an object, as a process
    that belongs to several worlds holds them: a TP engine's rank in its own group and in the sync's),
    each wait then bounded by `timeout_s` (a group formed with a longer timeout than its transfers get)."""
    if pg is None:
        return dist.isend if kind == "send" else dist.irecv
    post = pg.send if kind == "send" else pg.recv
    return lambda buf, peer, tag: _Bounded(post([buf], peer, tag), timeout_s)


class _Bounded:
    """A posted send or receive whose wait() is bounded by `timeout_s` (None: the group's own)."""

    def __init__(self, work, timeout_s: float | None):
        self.work, self.timeout_s = work, timeout_s

    def wait(self):
        if self.timeout_s is None:
            return self.work.wait()
        return self.work.wait(datetime.timedelta(seconds=self.timeout_s))


def _post(
    op, buf: torch.Tensor, t: Transfer, i: int, role: str, rank: int, plan: ReshardPlan, replica: int = 0
):
    """Post one isend / irecv, tagged with the transfer's index (a trainer's send to `replica`'s copy of
    the engine rank). Posted one by one rather than through dist.batch_isend_irecv (on gloo a loop over
    the same calls), so a post that gloo refuses because the peer is already gone names that peer."""
    peer = (
        plan.world_rank("engine", t.dst, replica) if role == "trainer" else plan.world_rank("trainer", t.src)
    )
    try:
        return op(buf, peer, tag=i)
    except Exception as exc:  # gloo raises RuntimeError / DistBackendError: named and re-raised
        raise _transfer_error(exc, t, i, role, rank, 0.0) from exc


def _post_broadcast(buf: torch.Tensor, t: Transfer, i: int, role: str, rank: int, plan: ReshardPlan, groups):
    """Post transfer `t`'s broadcast from its trainer rank to its engine rank group (the same call on
    every member, in plan order, so each group's collectives match)."""
    group = groups[(t.src, t.dst)]
    try:
        if isinstance(group, GroupBroadcast):
            return group.post(buf)
        return dist.broadcast(buf, src=plan.world_rank("trainer", t.src), group=group, async_op=True)
    except Exception as exc:  # gloo raises RuntimeError / DistBackendError: named and re-raised
        raise _transfer_error(exc, t, i, role, rank, 0.0) from exc


def _wait(work, t: Transfer, i: int, role: str, rank: int) -> None:
    t0 = time.monotonic()
    try:
        work.wait()
    except Exception as exc:  # gloo raises RuntimeError / DistBackendError: named and re-raised
        raise _transfer_error(exc, t, i, role, rank, time.monotonic() - t0) from exc


def _transfer_error(exc: BaseException, t: Transfer, i: int, role: str, rank: int, waited: float):
    peer = f"engine rank {t.dst}" if role == "trainer" else f"trainer rank {t.src}"
    return TransferError(
        f"{role} rank {rank}: transfer #{i} with {peer} failed after {waited:.1f}s "
        f"({t.describe()}): {type(exc).__name__}: {str(exc)[:300]}"
    )


def simulate(
    plan: ReshardPlan, trainer_locals: Mapping[int, Mapping[str, torch.Tensor]]
) -> dict[int, EngineShards]:
    """The plan's byte moves in one process (same cuts as send_shards / receive_shards, no wire): a
    check of the plan's arithmetic fast enough for thousands of drawn layouts."""
    engines = {r: EngineShards(plan, r) for r in range(plan.n_engines)}
    for r, local in trainer_locals.items():
        check_local_shards(plan, r, local)
    for i, t in enumerate(plan.transfers):
        view = _bytes(engines[t.dst].tensors[t.dest][t.dst_rows[0] : t.dst_rows[1]])
        data = _source_bytes(t, trainer_locals[t.src])
        if view.numel() != data.numel():
            raise ManifestMismatch(
                f"transfer #{i}: {t.nbytes} B planned, {data.numel()} B cut, {view.numel()} B of room: {t.describe()}"
            )
        view.copy_(data)
    return engines


def chunk_locals(plan: ReshardPlan, full: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Each trainer rank's local shards cut with torch.chunk (what Shard(0) holds), for `simulate`."""
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(plan.n_trainers)}
    for p in plan.trainer.params:
        t = full[p.name]
        parts = (
            [t] * plan.n_trainers
            if p.placement == REPLICATE
            else list(torch.chunk(t, plan.n_trainers, dim=0))
        )
        parts += [t[t.shape[0] :]] * (plan.n_trainers - len(parts))  # chunk returns fewer parts than ranks
        for r in range(plan.n_trainers):
            out[r][p.name] = parts[r]
    return out
