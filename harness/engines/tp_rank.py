"""One rank of the TP engine: its live engine shards (`reshard.oracle`'s cut of each parameter, nothing
more), the shards it has staged for the next version, its KV caches, and the commands the leader sends.

The per-rank receiver is `stage(version, {live name: shard})`: whatever delivers a rank's shards (the
leader here; the resharded sync's engine side later) stages them, and the leader's `commit` command swaps
them in on every rank at the same step boundary, after every rank has voted that it holds the whole
version: committed on all ranks or on none. A worker rank that hits any error exits: its peers' next
collective then fails at once instead of waiting out the group timeout."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from harness.engines import tp_model
from harness.engines.tp_group import (
    BUILT_KEY,
    READY_KEY,
    GlooCollectives,
    GroupInfo,
    client_store,
    join,
    receive_command,
)
from harness.reshard import ipc_plane
from harness.reshard.collective import join_world
from harness.reshard.layout import DTYPES, EngineLayout, ModelShape, engine_layout
from harness.reshard.oracle import expected_engine_shards
from harness.reshard.plan import plan_for_names
from harness.reshard.sync import (
    BROADCAST,
    IPC,
    P2P,
    EngineShards,
    join_broadcast_groups,
    receive_broadcast_shards,
    receive_shards,
)

# the commands a leader sends (tp_reference.TPReferenceEngine) and every rank serves
STEP, STAGE, COMMIT, DISCARD, READ, STOP = "step", "stage", "commit", "discard", "read", "stop"
# the resharded sync's (harness.reshard.path): join its world, receive a version's planned transfers from
# the trainer ranks straight into fresh shards and stage them, start again at version 0
JOIN_WORLD, RECEIVE, RESET = "join_world", "receive", "reset"
#: bytes of a rank's error text carried in the receive's all-gather (the leader names every rank's failure)
ERROR_BYTES = 400


def cut_shards(layout: EngineLayout, full: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shards of the parameters of `layout` whose sources `full` holds (a tied parameter is
    left out: it is the tensor it is tied to)."""
    params = tuple(p for p in layout.params if p.tied_to is None and all(s in full for s in p.sources))
    sub = EngineLayout(layout.n_ranks, layout.model, params)
    return {n: t.contiguous() for n, t in expected_engine_shards(full, sub, rank).items()}


def shard_shapes(layout: EngineLayout, dtype: str) -> list[dict[str, tuple[int, ...]]]:
    """Every rank's {live name: shard shape} (tied parameters left out)."""
    full = {n: torch.empty(s, dtype=DTYPES[dtype]) for n, s in layout.model.checkpoint_shapes().items()}
    return [
        {n: tuple(t.shape) for n, t in cut_shards(layout, full, r).items()} for r in range(layout.n_ranks)
    ]


class TPRank:
    """Rank `rank` of `m`: its shards of the model, version 0 cut from the seeded weights."""

    def __init__(
        self,
        rank: int,
        m: int,
        shape: ModelShape,
        dtype: str,
        seed: int,
        pg: dist.ProcessGroup,
        device: str = "cpu",
    ):
        self.rank, self.m, self.shape, self.dtype, self.pg = rank, m, shape, dtype, pg
        self.device = torch.device(device)  # where its shards live (collectives and commands go by the host)
        self.layout = engine_layout(shape, m)
        self.comm = GlooCollectives(pg, m)
        self.seed = seed
        self.world: dist.ProcessGroup | None = None  # the resharded sync's world, once joined
        self.world_rank: int | None = None
        self.wire = torch.device("cpu")  # where the world's collective delivers its messages
        self._broken_worlds: list[dist.ProcessGroup] = []  # kept: tearing down a failed gloo group may block
        self.plane = P2P  # the world's data plane; on the broadcast plane, this rank's groups in it
        self.groups: dict[tuple[int, int], object] = {}
        self.store: dist.Store | None = None  # the world's store (the ipc plane's buffers are named there)
        self.replica = 0
        self.opened = ipc_plane.OpenedBuffers()
        self._plans: dict[tuple, object] = {}
        self.reset()

    def reset(self) -> None:
        """Version 0 again (the seeded weights), nothing staged, no KV cache: a fresh engine's state."""
        self.live = {
            n: t.to(self.device)
            for n, t in cut_shards(
                self.layout, tp_model.init_weights(self.shape, self.dtype, self.seed), self.rank
            ).items()
        }
        self._tie(self.live)
        self.version = 0
        self.staged: dict[str, torch.Tensor] = {}
        self.staged_version: int | None = None
        self.caches: dict[int, tp_model.RankKVCache] = {}

    def _tie(self, shards: dict[str, torch.Tensor]) -> None:
        for p in self.layout.params:
            if p.tied_to is not None and p.tied_to in shards:
                shards[p.name] = shards[p.tied_to]

    # ------------------------------------------------------------------ the per-rank receiver
    def stage(self, version: int, shards: Mapping[str, torch.Tensor]) -> None:
        """Hold `shards` ({live name: this rank's shard}) for `version`; a new version drops what was staged."""
        if self.staged_version != version:
            self.staged, self.staged_version = {}, version
        self.staged.update({n: t.to(self.device) for n, t in shards.items()})

    def discard_staged(self) -> None:
        self.staged, self.staged_version = {}, None

    # ------------------------------------------------------------------ commands
    def serve(self, op: str, payload, outgoing: Sequence[Mapping[str, torch.Tensor]] | None = None):
        """Run one leader command on this rank (the leader with `outgoing`: every rank's staged shards)."""
        if op == STEP:
            return self.step(payload)
        if op == STAGE:
            return self.receive_stage(payload, outgoing)
        if op == COMMIT:
            return self.commit(payload["version"], payload["names"])
        if op == DISCARD:
            return self.discard_staged()
        if op == READ:
            return self.read(payload["shapes"])
        if op == JOIN_WORLD:
            return self.join_world(payload)
        if op == RECEIVE:
            return self.receive(payload)
        if op == RESET:
            return self.reset()
        raise ValueError(f"rank {self.rank}: unknown command {op!r}")

    def step(self, payload: dict) -> tuple[list[torch.Tensor], list[int]]:
        """One batch: a forward per entry [seq, tokens, fresh], over that request's cache; then every
        rank's live version, gathered, so the leader stamps a token only with a version all ranks ran."""
        for seq in payload["drop"]:
            self.caches.pop(seq, None)
        logits = []
        for seq, tokens, fresh in payload["batch"]:
            out, self.caches[seq] = tp_model.forward(
                self.shape,
                self.rank,
                self.m,
                self.live,
                tokens,
                None if fresh else self.caches[seq],
                self.comm,
            )
            logits.append(out.cpu())
        versions = self.comm.all_gather(torch.tensor([self.version], dtype=torch.int64))
        return logits, [int(v) for v in versions]

    def receive_stage(self, payload: dict, outgoing) -> None:
        """Stage this rank's shards of `payload["version"]`: the leader sends each worker its own."""
        version, names = payload["version"], payload["names"]
        if self.rank == 0:
            works = [
                self.pg.send([outgoing[r][n]], r, i) for r in range(1, self.m) for i, n in enumerate(names)
            ]
            for w in works:
                w.wait()
            self.stage(version, outgoing[0])
            return
        dtype = DTYPES[self.dtype]
        shapes = payload["shapes"][self.rank]
        got = {n: torch.empty(shapes[n], dtype=dtype) for n in names}
        for i, n in enumerate(names):
            self.pg.recv([got[n]], 0, i).wait()
        self.stage(version, got)

    def join_world(self, w: dict) -> None:
        """Join the resharded sync's world (its store at `w["port"]`, under `w["prefix"]`) as world rank
        `w["base"]` + this rank: a collective of every trainer and engine rank of the world, given
        `w["join_s"]` to form; each transfer in it is then bounded by `w["timeout_s"]`."""
        if self.world is not None:
            self._broken_worlds.append(self.world)
        self.world_rank = w["base"] + self.rank
        # its wire: where its messages land (host memory for gloo)
        store, self.world, self.wire = join_world(w, self.world_rank)
        self.world_timeout_s = w["timeout_s"]
        self._broken_worlds += [g.pg for g in self.groups.values()]
        self.plane = w.get("plane", P2P)
        self.replica = (w["base"] - w.get("trainers", 0)) // self.m
        self.groups = (
            join_broadcast_groups(store, w, "engine", self.rank, self.replica)
            if self.plane == BROADCAST
            else {}
        )
        self.store = dist.PrefixStore(f"{w['prefix']}/ipc", store)

    def receive(self, p: dict) -> list[list]:
        """Receive this rank's planned transfers of version `p["version"]` (checkpoint names `p["names"]`,
        from `p["trainers"]` trainer ranks, planner `p["planner"]`) into fresh shards and stage them; then
        every rank's outcome, gathered: [[ok, bytes received, error text], ...], rank 0 first. A failed
        receive stages nothing; the ranks stay in step (the group's own collectives are untouched)."""
        key = (p["trainers"], tuple(sorted(p["names"])), p["planner"])
        try:
            if self.world is None:
                raise RuntimeError("this rank has joined no resharding world")
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = plan_for_names(
                    self.shape, p["trainers"], self.m, self.dtype, p["names"], p["planner"]
                )
            if self.plane == IPC:  # straight out of the trainer ranks' buffers, on this rank's device
                shards = EngineShards(plan, self.rank, self.device)
                moved = ipc_plane.read(
                    self.store,
                    p["sync"],
                    plan,
                    self.rank,
                    shards,
                    self.replica,
                    self.world_timeout_s,
                    self.opened,
                )
            elif self.plane == BROADCAST:  # landed where the collective delivers, staged onto the device
                shards = EngineShards(plan, self.rank, self.wire)
                moved = receive_broadcast_shards(plan, self.rank, shards, self.groups)
            else:
                shards = EngineShards(plan, self.rank, self.wire)
                moved = receive_shards(plan, self.rank, shards, pg=self.world, timeout_s=self.world_timeout_s)
            tied = plan.tied()
            got = {n: t for n, t in shards.tensors.items() if n not in tied}
            self.check_digests(p["version"], got, p["digests"])
            error = ""
        except Exception as exc:  # noqa: BLE001 - reported to the leader through the gather below
            moved, got, error = 0, None, f"{type(exc).__name__}: {exc}"
            print(f"TP rank {self.rank}: receive failed: {error}", file=sys.stderr, flush=True)
        text = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
        raw = error.encode()[:ERROR_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else text[:0]
        head = torch.tensor([int(got is not None), moved], dtype=torch.int64)
        heads = self.comm.all_gather(head)
        texts = self.comm.all_gather(text)
        if got is not None and all(int(h[0]) for h in heads):
            self.stage(p["version"], got)
        else:
            self.discard_staged()
        return [
            [int(h[0]), int(h[1]), bytes(t.tolist()).rstrip(b"\0").decode(errors="replace")]
            for h, t in zip(heads, texts, strict=True)
        ]

    def check_digests(self, version: int, got: Mapping[str, torch.Tensor], entries: list[dict]) -> None:
        """Raise ManifestMismatch unless every shard received hashes to the manifest's digest for this rank."""
        from harness.api import ManifestMismatch
        from harness.manifest import digests_like

        want = {e["name"]: e["digest"] for e in entries if e["rank"] == self.rank}
        names = [n for n in got if n in want]
        # each with the manifest's algorithm (a shard on a GPU hashed as the trainer hashed it)
        have = dict(zip(names, digests_like([got[n] for n in names], [want[n] for n in names]), strict=True))
        wrong = [
            f"{n}: digest {have.get(n)}, the manifest says {want.get(n)}"
            for n in got
            if want.get(n) is None or want[n] != have[n]
        ]
        if wrong:
            raise ManifestMismatch(f"version {version}: engine rank {self.rank}: {'; '.join(wrong[:3])}")

    def vote(self, version: int, names: Sequence[str]) -> list[int]:
        """[1 if this rank holds every name of `version` staged and it is newer than its live one, the
        version it staged (-1: none), how many of `names` it staged, its live version]."""
        staged = self.staged_version if self.staged_version is not None else -1
        held = sum(n in self.staged for n in names)
        ok = staged == version and held == len(names) and version > self.version
        return [int(ok), staged, held, self.version]

    def commit(self, version: int, names: Sequence[str]) -> list[list[int]]:
        """Every rank's vote; if all are yes, swap the staged shards in (tied names follow), else drop them."""
        votes = self.comm.all_gather(torch.tensor(self.vote(version, names), dtype=torch.int64))
        votes = [v.tolist() for v in votes]
        if all(v[0] for v in votes):
            self.install(version)
        self.discard_staged()
        return votes

    def install(self, version: int) -> None:
        """The swap itself, between steps: a new dict, so no forward ever reads half of it."""
        live = {**self.live, **self.staged}
        self._tie(live)
        self.live, self.version = live, version

    def read(self, shapes) -> list[dict[str, torch.Tensor]] | None:
        """Every rank's live shards to the leader (tied names left out); the leader returns them all."""
        names = list(shapes[0])
        if self.rank != 0:
            for i, n in enumerate(names):
                self.pg.send([self.live[n].contiguous().cpu()], 0, i).wait()
            return None
        out = [{n: self.live[n].detach().to("cpu", copy=True) for n in names}]
        dtype = DTYPES[self.dtype]
        for r in range(1, self.m):
            got = {n: torch.empty(shapes[r][n], dtype=dtype) for n in names}
            for i, n in enumerate(names):
                self.pg.recv([got[n]], r, i).wait()
            out.append(got)
        return out


def rank_device_of(device: str | Sequence[str], rank: int) -> str:
    """TP rank `rank`'s device: the engine's one device, or its own of one per rank (a GPU per rank)."""
    return device if isinstance(device, str) else device[rank]


def rank_main(
    info: GroupInfo,
    shape: dict,
    dtype: str,
    seed: int,
    rank_impl: str,
    idle_s: float,
    device: str | Sequence[str] = "cpu",
) -> None:
    """A worker rank's life: join the group, serve the leader's commands until STOP; any error ends it."""
    from harness.registry import load_object

    torch.set_num_threads(1)
    try:
        store = client_store(info)
        store.add(READY_KEY, 1)  # up (imports done): the leader builds its side of the group now
        pg = join(info, store)
        rank = load_object(rank_impl)(
            info.rank,
            info.size,
            ModelShape(**shape),
            dtype,
            seed,
            pg,
            device=rank_device_of(device, info.rank),
        )
        store.add(BUILT_KEY, 1)  # built: the leader's first command may come now
        while True:
            op, payload = receive_command(pg, idle_s)
            if op == STOP:
                break
            rank.serve(op, payload)
    except BaseException:  # noqa: BLE001 - any error: exit, and the leader's next collective names it
        print(f"TP rank {info.rank}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)  # tearing down gloo and torch costs seconds; nothing is left to flush
