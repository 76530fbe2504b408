"""Sharded engine ranks on one device, each mapping the trainer's shards and copying only its planned
slices (issue 28 item 5), timed against the unsharded copy of the whole model.

The N trainer shards (torch.chunk of the full weights, what FSDP2's Shard(0) holds) live in this process,
one flat buffer per trainer rank. M engine-rank processes get a handle of each trainer buffer they read
from: a CUDA IPC handle (harness.paths.ipc.cuda_handle / open_cuda_handle) on a GPU, the shared-memory
tensor itself (torch.multiprocessing's file-descriptor sharing) on CPU. Each engine rank copies only the
byte ranges its transfers of the plan (harness.reshard.plan) name, straight into its own shard tensors (a
row-parallel column band is read strided, nothing is packed), then judges every shard bit for bit
against harness.reshard.oracle. The baseline is one engine process copying the whole model's bytes (one
buffer, one copy): what an unsharded engine on the same device pays.

Per (N, M): after warmup rounds, each round poisons the engine shards, releases every engine rank at
once, and times from the first rank's start to the last rank's end (host clock, after a device
synchronize); the median round is reported, with the median of the slowest rank's CUDA-event time.

    python -m harness.reshard.gpu_bench --device cuda --out DIR          # ~2.3 GiB bf16 model
    python -m harness.reshard.gpu_bench --device cpu --small --out DIR   # what CI runs

Writes DIR/reshard_bench.json and DIR/reshard_bench.md; exits 1 if any shard is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as tmp

from harness.checks import bitwise_mismatches
from harness.reshard.layout import (
    DTYPES,
    EngineLayout,
    ModelShape,
    TrainerLayout,
    engine_layout,
    full_weights,
    trainer_layout,
)
from harness.reshard.oracle import expected_engine_shards
from harness.reshard.plan import ReshardPlan, build_plan
from harness.reshard.sync import EngineShards, chunk_locals

#: Names the planner to bench (`pkg.module:function(trainer_layout, engine_layout)`), as test_reshard reads it
PLANNER_ENV = "WEIGHTSYNC_RESHARD_PLANNER"

#: Llama-shaped, ~1.13 G parameters: 2.3 GiB in bf16 (4 layers of a Llama-3-8B-sized block, untied head)
GPU_MODEL = ModelShape(
    vocab=32000, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, layers=4, tied=False
)
#: Small enough for CI on a 2-core machine; tied head and qkv bias so every split kind is exercised
SMALL_MODEL = ModelShape(
    vocab=1000, hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=512, layers=2, qkv_bias=True
)
ALIGN = 256  # byte alignment of each tensor in a flat buffer
COLUMNS = (
    "N trainer",
    "M engine",
    "transfers",
    "moved MiB",
    "minimum MiB",
    "median ms",
    "slowest rank ms",
    "GB/s",
    "x unsharded",
    "#wrong",
)


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ flat buffers
def flatten(tensors: dict[str, torch.Tensor], device: str) -> tuple[torch.Tensor, dict[str, list]]:
    """One uint8 buffer on `device` holding `tensors` back to back (each at an ALIGN-byte offset), and
    its index {name: [offset, shape]}."""
    index, size = {}, 0
    for name, t in tensors.items():
        index[name] = [size, list(t.shape)]
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    for name, t in tensors.items():
        off = index[name][0]
        buf[off : off + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    return buf, index


def views(buf: torch.Tensor, index: dict[str, list], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The typed tensors of a flat buffer, as views (no copy)."""
    item = torch.empty((), dtype=dtype).element_size()
    out = {}
    for name, (off, shape) in index.items():
        n = 1
        for d in shape:
            n *= d
        out[name] = buf[off : off + n * item].view(dtype).view(shape)
    return out


def share(buf: torch.Tensor):
    """What crosses to an engine process: a CUDA IPC handle (JSON), or the shared-memory CPU tensor."""
    if buf.is_cuda:
        from harness.paths.ipc import cuda_handle

        return cuda_handle(buf)
    return buf.share_memory_()


def open_shared(ref) -> torch.Tensor:
    if isinstance(ref, dict):
        from harness.paths.ipc import open_cuda_handle

        return open_cuda_handle(ref)
    return ref


# ------------------------------------------------------------------------------------ engine ranks
def _engine_process(conn, device: str) -> None:
    """One engine-rank slot: runs jobs from the bench until it sends None."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    while True:
        task = conn.recv()
        if task is None:
            return
        try:
            run = _copy_all if task["kind"] == "unsharded" else _sharded
            run(conn, device, task)
        except Exception as exc:  # noqa: BLE001 - reported to the bench, which fails the run
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


def _rounds(conn, device: str, copy, reset) -> None:
    """Warmup + timed rounds: reset (untimed), wait for the bench's go, copy, report host and GPU time."""
    gpu = device.startswith("cuda")
    for _ in range(conn.recv()):
        reset()
        _sync(device)
        conn.send("ready")
        conn.recv()  # go
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        copy()
        if gpu:
            end.record()
        _sync(device)
        t1 = time.perf_counter()
        conn.send({"t0": t0, "t1": t1, "gpu_s": start.elapsed_time(end) / 1e3 if gpu else t1 - t0})


def _sharded(conn, device: str, task: dict) -> None:
    plan = ReshardPlan.from_json(task["plan"])
    rank, dtype = task["rank"], DTYPES[plan.trainer.dtype]
    trainers = {int(r): views(open_shared(ref), idx, dtype) for r, (ref, idx) in task["trainers"].items()}
    shards = EngineShards(plan, rank, device)
    moves, moved, refused = [], 0, []
    for i, t in plan.receives_of(rank):
        src = trainers[t.src][t.source][t.src_rows[0] : t.src_rows[1]]
        if t.cols is not None:
            src = src[:, t.cols[0] : t.cols[1]]  # a strided band, read in place
        dst = shards.tensors[t.dest][t.dst_rows[0] : t.dst_rows[1]]
        if tuple(src.shape) != tuple(dst.shape) or src.numel() * src.element_size() != t.nbytes:
            # the plan cuts past a trainer shard: never copy a short slice; the shard stays poisoned
            refused.append(
                f"engine rank {rank}: transfer #{i} refused, source {tuple(src.shape)} for room "
                f"{tuple(dst.shape)}: {t.describe()}"
            )
            continue
        moves.append((dst, src))
        moved += t.nbytes

    def copy() -> None:
        for dst, src in moves:
            dst.copy_(src)

    conn.send({"moved": moved, "transfers": len(moves)})
    _rounds(conn, device, copy, shards.poison)
    full_ref, full_idx = task["full"]
    full = views(open_shared(full_ref), full_idx, dtype)
    if plan.engine.model.tied:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    with torch.device(device):  # the oracle's padding rows on the same device
        expected = expected_engine_shards(full, plan.engine, rank)
    wrong = [f"engine rank {rank}: {p}" for p in bitwise_mismatches(expected, shards.tensors)]
    conn.send({"wrong": refused + wrong})


def _copy_all(conn, device: str, task: dict) -> None:
    src = open_shared(task["full"])[: task["nbytes"]]
    dst = torch.empty_like(src)
    conn.send({"moved": src.numel(), "transfers": 1})
    _rounds(conn, device, lambda: dst.copy_(src), lambda: dst.fill_(0xA5))
    conn.send({"wrong": [] if torch.equal(dst, src) else ["the unsharded copy differs from the model"]})


# ------------------------------------------------------------------------------------ the bench
@dataclasses.dataclass
class Row:
    trainers: int
    engines: int
    transfers: int
    moved: int
    minimum: int
    median_s: float
    gpu_s: float
    rounds: list[float]
    wrong: list[str]
    vs_unsharded: float | None = None

    def cells(self) -> list[str]:
        n = "-" if self.trainers == 0 else str(self.trainers)
        return [
            n,
            str(self.engines),
            str(self.transfers),
            f"{self.moved / 2**20:.1f}",
            f"{self.minimum / 2**20:.1f}",
            f"{self.median_s * 1e3:.3f}",
            f"{self.gpu_s * 1e3:.3f}",
            f"{self.moved / self.median_s / 1e9:.1f}",
            "-" if self.vs_unsharded is None else f"{self.vs_unsharded:.2f}",
            str(len(self.wrong)),
        ]


class Bench:
    """M engine-rank slots started once; each job uses the first M of them."""

    def __init__(self, device: str, slots: int):
        ctx = tmp.get_context("spawn")
        self.device = device
        self.conns, self.procs = [], []
        for _ in range(slots):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_engine_process, args=(theirs, device), daemon=True)
            p.start()
            self.conns.append(mine)
            self.procs.append(p)

    def _recv(self, conn, timeout_s: float = 300.0):
        if not conn.poll(timeout_s):
            raise TimeoutError(f"an engine rank gave no answer in {timeout_s:g}s")
        msg = conn.recv()
        if isinstance(msg, dict) and "error" in msg:
            raise RuntimeError(f"engine rank failed: {msg['error']}")
        return msg

    def run(
        self, tasks: list[dict], warmup: int, repeats: int
    ) -> tuple[list[dict], list[float], list[float], list[str]]:
        conns = self.conns[: len(tasks)]
        for conn, task in zip(conns, tasks, strict=True):
            conn.send(task)
        setup = [self._recv(c) for c in conns]
        for c in conns:
            c.send(warmup + repeats)
        walls, gpus = [], []
        for i in range(warmup + repeats):
            for c in conns:
                self._recv(c)  # ready: poisoned, synchronized
            for c in conns:
                c.send("go")
            times = [self._recv(c) for c in conns]
            if i >= warmup:
                walls.append(max(t["t1"] for t in times) - min(t["t0"] for t in times))
                gpus.append(max(t["gpu_s"] for t in times))
        wrong = [w for c in conns for w in self._recv(c)["wrong"]]
        return setup, walls, gpus, wrong

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs, strict=True):
            try:
                c.send(None)
            except OSError:
                pass
            p.join(10)
            if p.is_alive():
                p.kill()


def _full_on(model: ModelShape, dtype: str, seed: int, device: str) -> dict[str, torch.Tensor]:
    """The full checkpoint on `device` (random bit patterns, as layout.full_weights; drawn on the device
    itself for a GPU, where a CPU draw of gigabytes would take most of the run)."""
    if not device.startswith("cuda"):
        return full_weights(model, dtype, seed)
    torch_dtype = DTYPES[dtype]
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[torch.empty((), dtype=torch_dtype).element_size()]
    info = torch.iinfo(bits)
    g = torch.Generator(device=device).manual_seed(seed)
    out = {
        name: torch.randint(info.min, info.max, shape, dtype=bits, device=device, generator=g).view(
            torch_dtype
        )
        for name, shape in model.checkpoint_shapes().items()
    }
    if model.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def bench(
    model: ModelShape,
    device: str,
    dtype: str = "bfloat16",
    trainers: tuple[int, ...] = (1, 2),
    engines: tuple[int, ...] = (1, 2),
    warmup: int = 3,
    repeats: int = 10,
    planner: Callable[[TrainerLayout, EngineLayout], ReshardPlan] = build_plan,
) -> list[Row]:
    """The unsharded baseline, then every (N, M): rows with time, bytes and shards found wrong."""
    for m in engines:
        model.check_tp(m)
    log(f"model {model} {dtype} on {device}")
    full = _full_on(model, dtype, seed=0, device=device)
    names = [p.name for p in trainer_layout(model, 1, dtype).params]
    full_buf, full_idx = flatten({n: full[n] for n in names}, device)
    del full
    _sync(device)
    nbytes = sum(t.numel() * t.element_size() for t in views(full_buf, full_idx, DTYPES[dtype]).values())
    log(
        f"model: {nbytes / 2**30:.2f} GiB in {len(names)} tensors; starting {max(engines)} engine-rank process(es)"
    )
    full_ref = share(full_buf)
    rows = []
    b = Bench(device, max(engines))
    try:
        t = time.monotonic()
        setup, walls, gpus, wrong = b.run(
            [{"kind": "unsharded", "full": full_ref, "nbytes": full_buf.numel()}], warmup, repeats
        )
        base = Row(
            0, 1, 1, full_buf.numel(), nbytes, statistics.median(walls), statistics.median(gpus), walls, wrong
        )
        rows.append(base)
        log(f"unsharded copy: {base.median_s * 1e3:.3f} ms median ({time.monotonic() - t:.1f}s)")
        full_local = views(full_buf, full_idx, DTYPES[dtype])
        if model.tied:
            full_local["lm_head.weight"] = full_local["model.embed_tokens.weight"]
        for n in trainers:
            for m in engines:
                t = time.monotonic()
                plan = planner(trainer_layout(model, n, dtype), engine_layout(model, m))
                flats = {r: flatten(local, device) for r, local in chunk_locals(plan, full_local).items()}
                _sync(device)
                refs = {r: (share(buf), idx) for r, (buf, idx) in flats.items()}
                tasks = []
                for e in range(m):
                    need = sorted({tr.src for _, tr in plan.receives_of(e)})
                    tasks.append(
                        {
                            "kind": "sharded",
                            "plan": plan.to_json(),
                            "rank": e,
                            "trainers": {r: refs[r] for r in need},
                            "full": (full_ref, full_idx),
                        }
                    )
                setup, walls, gpus, wrong = b.run(tasks, warmup, repeats)
                row = Row(
                    n,
                    m,
                    sum(s["transfers"] for s in setup),
                    sum(s["moved"] for s in setup),
                    plan.minimum_bytes()["total"],
                    statistics.median(walls),
                    statistics.median(gpus),
                    walls,
                    wrong,
                    statistics.median(walls) / base.median_s,
                )
                rows.append(row)
                log(
                    f"N={n} M={m}: {row.transfers} transfers, {row.median_s * 1e3:.3f} ms median, "
                    f"{row.vs_unsharded:.2f}x unsharded, {len(wrong)} wrong ({time.monotonic() - t:.1f}s)"
                )
                del refs, flats, tasks
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    finally:
        b.close()
    return rows


def markdown(rows: list[Row], meta: dict) -> str:
    """The result table: the unsharded baseline first (N '-'), then every (N, M)."""
    lines = [
        f"# Resharded sync on one device: {meta['device_name']}",
        "",
        f"`{meta['command']}` — {meta['model']}, {meta['dtype']}, {meta['model_bytes'] / 2**30:.2f} GiB; "
        f"median of {meta['repeats']} rounds after {meta['warmup']} warmup; {meta['when']}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("--:" for _ in COLUMNS) + " |",
    ]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    lines += [
        "",
        "Row `-`: the unsharded path, one engine process copying the whole model (one buffer) from the trainer's.",
        "moved = bytes the engine ranks copied (sum), minimum = the plan's minimum (checkpoint bytes each engine "
        "rank's shards hold, summed); median ms = first engine rank's start to last one's end, host clock after a "
        "device synchronize; slowest rank ms = the slowest engine rank's own copy time (CUDA events on a GPU, host "
        "clock on CPU); GB/s = moved / median; x unsharded = median / the unsharded median; "
        "#wrong = engine shards not equal to harness.reshard.oracle bit for bit (must be 0).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m harness.reshard.gpu_bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--device", default="cuda", help="cuda, cuda:K or cpu (default cuda)")
    ap.add_argument(
        "--out", required=True, type=Path, help="folder for reshard_bench.json and reshard_bench.md"
    )
    ap.add_argument("--small", action="store_true", help="the small CI model instead of the ~2.3 GiB one")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, help="override the model's layer count (size)")
    ap.add_argument(
        "--planner",
        default=os.environ.get(PLANNER_ENV, "harness.reshard.plan:build_plan"),
        help=f"pkg.module:function making the plan (default: ${PLANNER_ENV} or harness.reshard.plan:build_plan)",
    )
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_bench: --device cuda, but torch.cuda is not available (use --device cpu)", file=sys.stderr)
        return 2
    if args.device == "cuda":
        args.device = f"cuda:{torch.cuda.current_device()}"  # torch.cuda.set_device refuses a bare "cuda"
    model = SMALL_MODEL if args.small else GPU_MODEL
    if args.layers:
        model = dataclasses.replace(model, layers=args.layers)
    t0 = time.monotonic()
    module, _, name = args.planner.partition(":")
    planner = getattr(importlib.import_module(module), name)
    rows = bench(model, args.device, args.dtype, warmup=args.warmup, repeats=args.repeats, planner=planner)
    meta = {
        "command": "python -m harness.reshard.gpu_bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "model": dataclasses.asdict(model),
        "model_bytes": rows[0].minimum,
        "dtype": args.dtype,
        "planner": args.planner,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reshard_bench.json").write_text(
        json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2)
    )
    table = markdown(rows, {**meta, "model": model})
    (args.out / "reshard_bench.md").write_text(table)
    print(table)
    wrong = sum(len(r.wrong) for r in rows)
    for r in rows:
        for w in r.wrong[:5]:
            print(f"WRONG N={r.trainers} M={r.engines}: {w}", file=sys.stderr)
    log(f"done in {meta['seconds']}s; {wrong} wrong shard(s); {args.out / 'reshard_bench.md'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
