"""The resharding plan: computed once from the trainer's and the engine's layouts, reused every step.

A plan is a list of `Transfer`s. Each names the trainer rank that owns the bytes, the engine rank that
needs them, the rows (and for a row-parallel engine parameter, the columns) of the trainer's local
shard they are cut from, and the rows of the engine shard they land in. An engine shard is filled
row-contiguously, so every transfer lands in one byte range; it leaves one byte range of the trainer
shard too unless it takes a column band (row parallel), which the sender packs. Nothing is gathered:
every transfer is one trainer shard's bytes to one engine rank, and a byte travels once per engine
shard that holds it (replicated norms and replicated kv heads travel once to each rank that holds
them). The plan is plain data: deterministic, JSON both ways, printable as a table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable

import torch

from harness.reshard.layout import (
    COLUMN,
    DTYPES,
    MERGED,
    QKV,
    REPLICATE,
    REPLICATED,
    ROW,
    VOCAB,
    EngineLayout,
    EngineParam,
    ModelShape,
    TrainerLayout,
    TrainerParam,
    engine_layout,
    trainer_layout,
)

Span = tuple[int, int]  # [start, stop)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows `rows` (and columns `cols`, None: all) of checkpoint tensor `source`, which fill an engine
    shard from its row `dst_row` on."""

    source: str
    rows: Span
    cols: Span | None
    dst_row: int


@dataclasses.dataclass(frozen=True)
class EngineShard:
    """What engine rank `rank` holds of live parameter `name`: its shape, the segments that fill it in
    row order, and the padding rows after them (vLLM's vocab padding, zeros)."""

    name: str
    rank: int
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    pad_rows: int = 0


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One message: rows `src_rows` (columns `cols`) of trainer rank `src`'s local shard of `source`
    into rows `dst_rows` of engine rank `dst`'s shard of `dest`; `nbytes` bytes. `src_bytes` /
    `dst_bytes` are the byte ranges in the local shard / engine shard (src_bytes None: a column band,
    packed by the sender)."""

    src: int
    dst: int
    source: str
    src_rows: Span
    cols: Span | None
    dest: str
    dst_rows: Span
    nbytes: int
    src_bytes: Span | None
    dst_bytes: Span

    def describe(self) -> str:
        cols = f", cols {self.cols[0]}:{self.cols[1]}" if self.cols else ""
        return (
            f"{self.source} local rows {self.src_rows[0]}:{self.src_rows[1]}{cols} of trainer rank {self.src} "
            f"-> {self.dest} rows {self.dst_rows[0]}:{self.dst_rows[1]} of engine rank {self.dst} ({self.nbytes} B)"
        )


def _row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shape[1:]) * itemsize


def _split(total: int, m: int, rank: int) -> Span:
    """vLLM's even split (it asserts divisibility; ModelShape.check_tp refuses what it cannot split)."""
    size = total // m
    return rank * size, (rank + 1) * size


def engine_shards(layout: EngineLayout, shapes: dict[str, tuple[int, ...]], rank: int) -> list[EngineShard]:
    """Every live parameter's shard on engine `rank` (tied ones are not listed: they share storage)."""
    model, m = layout.model, layout.n_ranks
    out = []
    for p in layout.params:
        if p.tied_to is None:
            out.append(_engine_shard(p, model, m, rank, shapes))
    return out


def _engine_shard(p: EngineParam, model: ModelShape, m: int, rank: int, shapes) -> EngineShard:
    first = shapes[p.sources[0]]
    tail = first[1:]
    if p.kind == REPLICATED:
        return EngineShard(p.name, rank, first, (Segment(p.sources[0], (0, first[0]), None, 0),))
    if p.kind == COLUMN:
        rows = _split(first[0], m, rank)
        return EngineShard(p.name, rank, (rows[1] - rows[0], *tail), (Segment(p.sources[0], rows, None, 0),))
    if p.kind == ROW:
        cols = _split(first[1], m, rank) if m > 1 else None
        width = first[1] // m
        return EngineShard(p.name, rank, (first[0], width), (Segment(p.sources[0], (0, first[0]), cols, 0),))
    if p.kind == VOCAB:
        per = model.padded_vocab(m) // m
        start = rank * per
        stop = min(start + per, first[0])
        segs = (Segment(p.sources[0], (start, stop), None, 0),) if stop > start else ()
        return EngineShard(p.name, rank, (per, *tail), segs, pad_rows=per - max(stop - start, 0))
    if p.kind in (QKV, MERGED):
        spans = _qkv_rows(model, m, rank) if p.kind == QKV else None
        segs, at = [], 0
        for i, src in enumerate(p.sources):
            rows = spans[i] if spans else _split(shapes[src][0], m, rank)
            segs.append(Segment(src, rows, None, at))
            at += rows[1] - rows[0]
        return EngineShard(p.name, rank, (at, *tail), tuple(segs))
    raise ValueError(f"{p.name}: unknown split kind {p.kind!r}")


def _qkv_rows(model: ModelShape, m: int, rank: int) -> list[Span]:
    """q, k and v rows of engine `rank` (QKVParallelLinear: kv heads split, or replicated over
    m // kv_heads ranks each when m >= kv_heads: vLLM's num_kv_head_replicas = tp_size //
    total_num_kv_heads, and rank r loads kv head r // num_kv_head_replicas, so ranks 0..R-1 hold head 0,
    ranks R..2R-1 head 1, and so on, in blocks, not round robin)."""
    hd = model.head_dim
    q = _split(model.heads * hd, m, rank)
    if m >= model.kv_heads:
        head = rank // (m // model.kv_heads)
        kv = (head * hd, (head + 1) * hd)
    else:
        kv = _split(model.kv_heads * hd, m, rank)
    return [q, kv, kv]


def world_rank(n_trainers: int, n_engines: int, role: str, rank: int, replica: int = 0) -> int:
    """A rank's place in a resharding world: trainer ranks first, then each engine replica's ranks,
    replica by replica."""
    return rank if role == "trainer" else n_trainers + replica * n_engines + rank


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    trainer: TrainerLayout
    engine: EngineLayout
    shards: tuple[EngineShard, ...]
    transfers: tuple[Transfer, ...]

    # ------------------------------------------------------------------------------ queries
    @property
    def n_trainers(self) -> int:
        return self.trainer.n_ranks

    @property
    def n_engines(self) -> int:
        return self.engine.n_ranks

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPES[self.trainer.dtype]).element_size()

    def world_rank(self, role: str, rank: int, replica: int = 0) -> int:
        """This plan's rank `rank` of `role` in its world (module function `world_rank`)."""
        return world_rank(self.n_trainers, self.n_engines, role, rank, replica)

    def sends_of(self, trainer_rank: int) -> list[tuple[int, Transfer]]:
        return [(i, t) for i, t in enumerate(self.transfers) if t.src == trainer_rank]

    def receives_of(self, engine_rank: int) -> list[tuple[int, Transfer]]:
        return [(i, t) for i, t in enumerate(self.transfers) if t.dst == engine_rank]

    def shards_of(self, engine_rank: int) -> list[EngineShard]:
        return [s for s in self.shards if s.rank == engine_rank]

    def tied(self) -> dict[str, str]:
        """{tied live name: the live name it shares storage with}"""
        return {p.name: p.tied_to for p in self.engine.params if p.tied_to}

    def bytes_per_rank(self) -> dict[str, int]:
        """Bytes the plan sends from each trainer rank and delivers to each engine rank."""
        out = {f"trainer {r}": 0 for r in range(self.n_trainers)}
        out.update({f"engine {r}": 0 for r in range(self.n_engines)})
        for t in self.transfers:
            out[f"trainer {t.src}"] += t.nbytes
            out[f"engine {t.dst}"] += t.nbytes
        return out

    def minimum_bytes(self) -> dict[str, int]:
        """What each engine rank must receive at least: the bytes of its shards that come from the
        checkpoint (padding excluded, a tied parameter once), read from the shards, not the transfers.
        'total' is their sum: each byte once per engine shard that holds it."""
        out = {}
        for r in range(self.n_engines):
            out[f"engine {r}"] = sum(
                (s.shape[0] - s.pad_rows) * _row_bytes(s.shape, self.itemsize) for s in self.shards_of(r)
            )
        out["total"] = sum(out.values())
        return out

    # ------------------------------------------------------------------------------ rendering
    def table(self) -> str:
        """The plan as a person reads it: one line per transfer (trainer rank tN -> engine rank eM, the
        rows of the trainer's local shard, the columns, the rows of the engine shard), the tied names,
        then bytes per rank against the minimum."""
        w = max([len(t.source) for t in self.transfers] + [len(t.dest) for t in self.transfers] + [6])
        head = (
            f"resharding plan: {self.n_trainers} trainer rank(s) -> {self.n_engines} engine rank(s), "
            f"{self.trainer.dtype}, {len(self.transfers)} transfers"
        )
        cols = (
            f"{'#':>4} {'src':>4} {'dst':>4} {'source':<{w}} {'src rows':>11} {'cols':>9} "
            f"{'dest':<{w}} {'dst rows':>11} {'bytes':>9}"
        )
        lines = [head, cols]
        for i, t in enumerate(self.transfers):
            c = f"{t.cols[0]}:{t.cols[1]}" if t.cols else "all"
            lines.append(
                f"{i:>4} {'t' + str(t.src):>4} {'e' + str(t.dst):>4} {t.source:<{w}} "
                f"{f'{t.src_rows[0]}:{t.src_rows[1]}':>11} {c:>9} {t.dest:<{w}} "
                f"{f'{t.dst_rows[0]}:{t.dst_rows[1]}':>11} {t.nbytes:>9}"
            )
        for live, to in self.tied().items():
            lines.append(f"     tied: {live} is {to} on every engine rank (no bytes of its own)")
        lines.append(self.bytes_table())
        return "\n".join(lines)

    def bytes_table(self, measured: dict[str, int] | None = None) -> str:
        """Bytes per rank: planned, the minimum the layouts allow (engine ranks: their shards' checkpoint
        bytes; total: their sum), and, given, what a sync measured ('total' measured: bytes received)."""
        planned, minimum = self.bytes_per_rank(), self.minimum_bytes()
        lines = [
            f"{'rank':<10} {'planned B':>11} {'minimum B':>11}" + (f" {'measured B':>11}" if measured else "")
        ]
        for k, v in planned.items():
            lo = str(minimum[k]) if k in minimum else "-"
            got = f" {measured.get(k, '-')!s:>11}" if measured else ""
            lines.append(f"{k:<10} {v:>11} {lo:>11}{got}")
        total = sum(t.nbytes for t in self.transfers)
        got = ""
        if measured:
            got = f" {sum(v for k, v in measured.items() if k.startswith('engine')):>11}"
        lines.append(f"{'total':<10} {total:>11} {minimum['total']:>11}{got}")
        return "\n".join(lines)

    def report_record(
        self,
        measured: dict[str, int] | None = None,
        replicas: int = 1,
        data_plane: tuple[str, str] | None = None,
    ) -> dict:
        """The plan as results.json carries it for report.md / report.html (`reshard_plan` in a test's
        record): one row per transfer, the tied names, bytes per rank (planned, minimum, measured), and,
        given, the engine replicas and the data plane that moved the bytes with why it was chosen
        (harness.reshard.sync.choose_data_plane)."""
        planned, minimum = self.bytes_per_rank(), self.minimum_bytes()
        got = measured or {}
        ranks = [
            {"rank": k, "planned": v, "minimum": minimum.get(k), "measured": got.get(k)}
            for k, v in planned.items()
        ]
        received = sum(v for k, v in got.items() if k.startswith("engine")) if measured else None
        total = sum(t.nbytes for t in self.transfers)
        ranks.append({"rank": "total", "planned": total, "minimum": minimum["total"], "measured": received})
        plane = {"data_plane": data_plane[0], "data_plane_why": data_plane[1]} if data_plane else {}
        return {
            **plane,
            "replicas": replicas,
            "trainers": self.n_trainers,
            "engines": self.n_engines,
            "dtype": self.trainer.dtype,
            "model": dataclasses.asdict(self.engine.model),
            "transfers": [
                {
                    "src": t.src,
                    "dst": t.dst,
                    "source": t.source,
                    "src_rows": f"{t.src_rows[0]}:{t.src_rows[1]}",
                    "cols": f"{t.cols[0]}:{t.cols[1]}" if t.cols else "all",
                    "dest": t.dest,
                    "dst_rows": f"{t.dst_rows[0]}:{t.dst_rows[1]}",
                    "bytes": t.nbytes,
                }
                for t in self.transfers
            ],
            "tied": self.tied(),
            "bytes": ranks,
        }

    __str__ = table

    # ------------------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json(cls, data: dict) -> ReshardPlan:
        tr = data["trainer"]
        trainer = TrainerLayout(
            tr["n_ranks"],
            tr["dtype"],
            tuple(TrainerParam(p["name"], tuple(p["shape"]), p["placement"]) for p in tr["params"]),
        )
        en = data["engine"]
        engine = EngineLayout(
            en["n_ranks"],
            ModelShape(**en["model"]),
            tuple(EngineParam(p["name"], p["kind"], tuple(p["sources"]), p["tied_to"]) for p in en["params"]),
        )
        shards = tuple(
            EngineShard(
                s["name"],
                s["rank"],
                tuple(s["shape"]),
                tuple(
                    Segment(g["source"], _span(g["rows"]), _span(g["cols"]), g["dst_row"])
                    for g in s["segments"]
                ),
                s["pad_rows"],
            )
            for s in data["shards"]
        )
        transfers = tuple(
            Transfer(
                t["src"],
                t["dst"],
                t["source"],
                _span(t["src_rows"]),
                _span(t["cols"]),
                t["dest"],
                _span(t["dst_rows"]),
                t["nbytes"],
                _span(t["src_bytes"]),
                _span(t["dst_bytes"]),
            )
            for t in data["transfers"]
        )
        return cls(trainer, engine, shards, transfers)


def _span(v: Iterable[int] | None) -> Span | None:
    return None if v is None else tuple(v)  # type: ignore[return-value]


def build_plan(
    trainer: TrainerLayout, engine: EngineLayout, shards: Iterable[EngineShard] | None = None
) -> ReshardPlan:
    """The plan for these two layouts: every engine shard's segments cut along the trainer's shard
    boundaries. A replicated trainer parameter is sent by the trainer rank that has sent the fewest
    bytes so far (lowest rank on a tie), so no rank carries every replicated tensor. `shards`: the
    engine shards to fill (default: vLLM's cuts, `engine_shards` of every rank; the meta tier's broken
    planners pass shards cut otherwise)."""
    itemsize = torch.empty((), dtype=DTYPES[trainer.dtype]).element_size()
    shapes = {p.name: p.shape for p in trainer.params}
    missing = sorted({s for p in engine.params for s in p.sources} - set(shapes))
    if missing:
        raise ValueError(f"engine parameters need checkpoint tensors the trainer does not hold: {missing}")
    if shards is None:
        shards = [s for r in range(engine.n_ranks) for s in engine_shards(engine, shapes, r)]
    shards = list(shards)
    sent = [0] * trainer.n_ranks
    transfers: list[Transfer] = []
    for shard in shards:
        dst_row_bytes = _row_bytes(shard.shape, itemsize)
        for seg in shard.segments:
            src_shape = shapes[seg.source]
            src_row_bytes = _row_bytes(src_shape, itemsize)
            band = src_row_bytes if seg.cols is None else (seg.cols[1] - seg.cols[0]) * itemsize
            if trainer.param(seg.source).placement == REPLICATE:
                owners = [min(range(trainer.n_ranks), key=lambda r: (sent[r], r))]
            else:
                owners = list(range(trainer.n_ranks))
            for r in owners:
                lo, hi = trainer.rows_of(seg.source, r)
                a, b = max(seg.rows[0], lo), min(seg.rows[1], hi)
                if b <= a:
                    continue
                local = (a - lo, b - lo)
                dst = (seg.dst_row + a - seg.rows[0], seg.dst_row + b - seg.rows[0])
                nbytes = (b - a) * band
                transfers.append(
                    Transfer(
                        r,
                        shard.rank,
                        seg.source,
                        local,
                        seg.cols,
                        shard.name,
                        dst,
                        nbytes,
                        (local[0] * src_row_bytes, local[1] * src_row_bytes) if seg.cols is None else None,
                        (dst[0] * dst_row_bytes, dst[1] * dst_row_bytes),
                    )
                )
                sent[r] += nbytes
    return ReshardPlan(trainer, engine, tuple(shards), tuple(transfers))


#: The planner a resharded sync uses unless this names another (`pkg.module:function(trainer_layout,
#: engine_layout) -> ReshardPlan`): the meta tier's broken planners are selected so.
PLANNER_ENV = "WEIGHTSYNC_RESHARD_PLANNER"
DEFAULT_PLANNER = "harness.reshard.plan:build_plan"


def planner_path() -> str:
    """The planner this process uses (PLANNER_ENV, else build_plan), as an import path."""
    return os.environ.get(PLANNER_ENV) or DEFAULT_PLANNER


def plan_for_names(
    model: ModelShape, n_trainers: int, m: int, dtype: str, names: Iterable[str], planner: str | None = None
) -> ReshardPlan:
    """The plan of a version that holds the checkpoint tensors `names` (all of the model, or part of it):
    the engine parameters all of whose sources it holds, from those trainer parameters. Every rank of a
    resharded sync computes it for itself from these same arguments, so every side moves the same bytes."""
    from harness.registry import load_object

    names = set(names)
    full_t = trainer_layout(model, n_trainers, dtype)
    full_e = engine_layout(model, m)
    params = tuple(p for p in full_e.params if all(s in names for s in p.sources))
    sources = {s for p in params for s in p.sources}
    trainer = TrainerLayout(n_trainers, dtype, tuple(p for p in full_t.params if p.name in sources))
    return load_object(planner or planner_path())(trainer, EngineLayout(m, model, params))
