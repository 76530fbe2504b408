"""Validate a cluster before a run: every trainer → rollout link and each rollout group's broadcast, measured
over the real fabric at sizes from 1 MiB up, judged against the rating the operator gives; then a short
conformance smoke (a full update and a sparse patch, each checked bit for bit on every rollout rank).

Launched with torchrun on every node (torchrun's rendezvous; the harness adds no launcher):

    torchrun --nproc-per-node=4 -m harness.validate_cluster --trainer-ranks 0 --rollout-ranks 1-3
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 -m harness.validate_cluster \\
        --trainer-ranks 0-7 --rollout-ranks 8-11 --rollout-ranks 12-15 --rating-gbps 400

Every rank measures; rank 0 prints the table and the verdict and writes `validate-cluster.json` and
`validate-cluster.html`. A link below the floor (a fraction of the rating's payload rate) is named with both
ends' hostnames and devices. Every collective gives up after --timeout-s and the smoke is reported through
the rendezvous store, so a rank that dies is named within a bound instead of hanging the others.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from harness.api import TensorSpec
from harness.checks import first_difference
from harness.engines import tiny_lm
from harness.engines.reference import ReferenceEngine
from harness.engines.tiny_lm import ModelConfig
from harness.manifest import Manifest, dtype_from_name, dtype_name
from harness.registry import make_engine
from harness.report.html_page import render_validate_cluster

#: Share of a link's raw rate that carries payload (framing, headers, flow control): 400 Gb/s NDR
#: = 50 GB/s raw, about 45 GB/s of payload.
PAYLOAD_SHARE = 0.9
EXIT_PASS, EXIT_FAIL = 0, 1
#: how long after its collectives' timeout a live rank has to post its smoke report
REPORT_GRACE_S = 5.0
#: Stopped (SIGTERM, SIGINT) during the smoke: how long rank 0 still waits for the reports, so the verdict can
#: name a dead rank; the whole stop stays within harness.stopping.STOP_BOUND_S (the watcher ends it at
#: STOP_GRACE_S whatever the rank waits on).
STOP_REPORT_S, STOP_GRACE_S = 5.0, 7.5


def parse_ranks(text: str) -> list[int]:
    """'0', '1-3', '0,2,4-5' → rank numbers; a ValueError naming the text otherwise."""
    from harness.cli_args import ranks

    try:
        return ranks(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"rank range {exc}") from None


def payload_gbs(rating_gbps: float) -> float:
    """A link rated in Gb/s (bits, as vendors rate them) as GB/s of payload."""
    return rating_gbps / 8 * PAYLOAD_SHARE


@dataclass
class Link:
    kind: str  # "p2p" or "broadcast"
    src: int
    dst: list[int]
    size_bytes: int
    time_s: float
    ends: str  # "host:device -> host:device, ..."

    @property
    def gbs(self) -> float:
        return self.size_bytes / self.time_s / 1e9


def _identity(rank: int, device: torch.device) -> str:
    return f"rank {rank} ({socket.gethostname()}, {device})"


def _timed(fn, group=None, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of fn, each from a barrier to a barrier of `group` (so it is the time
    until every party has finished, measured the same on every rank)."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        dist.barrier(group=group)
        best = min(best, time.perf_counter() - t0)
    return best


class Steps:
    """Progress, on rank 0 only: a rich bar on a terminal, one plain line per step where stdout is not a
    terminal or CI=true (logs keep every line; a bar would leave escape codes)."""

    def __init__(self, total: int, show: bool, file=None, terminal: bool | None = None):
        self.total, self.done, self.show = total, 0, show
        self.file = file or sys.stdout
        if terminal is None:
            terminal = self.file.isatty() and os.environ.get("CI", "").lower() != "true"
        self._bar = None
        if show and terminal:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(file=self.file, force_terminal=True)
            self._bar = Progress(
                TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=True,
            )  # fmt: skip
            self._bar.start()
            self._task = self._bar.add_task("validate-cluster", total=total)

    def __call__(self, what: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=what)
        elif self.show:
            print(f"[{self.done}/{self.total}] {what}", file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def measure_links(
    trainers, groups, sizes, device, who, repeats, timeout: timedelta | None = None, step=lambda what: None
) -> list[Link]:
    """Every trainer → rollout pair point to point, then each group's broadcast from the first trainer.
    Every rank calls this (collectives need all of them); rank 0's list is the one reported."""
    rank = dist.get_rank()
    links: list[Link] = []
    pairs = [(t, r) for t in trainers for g in groups for r in g]
    # every rank creates every group, in the same order (new_group is collective)
    pair_groups = {pair: dist.new_group(list(pair), timeout=timeout) for pair in pairs}
    cast_groups = [dist.new_group([trainers[0], *g], timeout=timeout) for g in groups]
    for size in sizes:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        for t, r in pairs:
            pair = pair_groups[(t, r)]

            def move(t=t, r=r, buf=buf):
                if rank == t:
                    dist.send(buf, dst=r)
                elif rank == r:
                    dist.recv(buf, src=t)

            if rank in (t, r):
                links.append(Link("p2p", t, [r], size, _timed(move, pair, repeats), f"{who[t]} -> {who[r]}"))
            step(f"p2p {t} -> {r}, {size / 2**20:g} MiB")
        for g, group in zip(groups, cast_groups):
            members = [trainers[0], *g]
            if rank in members:

                def cast(group=group, buf=buf):
                    dist.broadcast(buf, src=trainers[0], group=group)

                ends = f"{who[trainers[0]]} -> " + ", ".join(who[r] for r in g)
                links.append(
                    Link("broadcast", trainers[0], list(g), size, _timed(cast, group, repeats), ends)
                )
            step(f"broadcast {trainers[0]} -> {','.join(map(str, g))}, {size / 2**20:g} MiB")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [asdict(link) for link in links])
    seen, out = set(), []
    for rank_links in gathered:  # each link is reported by its own ends: keep one copy, the first
        for d in rank_links:
            key = (d["kind"], d["src"], tuple(d["dst"]), d["size_bytes"])
            if key not in seen:
                seen.add(key)
                out.append(Link(**d))
    return sorted(out, key=lambda link: (link.kind != "p2p", link.src, link.dst, link.size_bytes))


def smoke(
    trainers,
    groups,
    device,
    seed: int = 0,
    kill_rank=None,
    hang_rank=None,
    corrupt_rank=None,
    timeout: timedelta | None = None,
    step=lambda what: None,
    engine_name: str = "reference",
) -> list[str]:
    """A full update, then a sparse patch, from the first trainer to every rollout rank over the fabric;
    each rollout rank commits them into a reference engine and checks every tensor the engine then serves
    bit for bit against the manifest's digests. Returns this rank's
    failures (`report_in` collects everyone's). Fault injection, for the harness's own tests: `kill_rank`
    SIGKILLs itself after version 1 (mid-smoke), `hang_rank` SIGSTOPs itself there (its sockets stay
    open: only the timeout can tell); `corrupt_rank` flips one bit of what it received.
    `timeout`: every collective of the smoke gives up after it (new groups default to 30 min, not the
    world's timeout). `engine_name`: the rollout side's engine (harness.registry: `vllm` is real vLLM in
    process); one that serves a fixed model (vLLM) gets its own tensors' shapes and dtypes, which the first
    rollout rank announces, filled with seeded random values."""
    rank = dist.get_rank()
    rollouts = sorted(r for g in groups for r in g)
    members = [trainers[0], *rollouts]
    group = dist.new_group(members, timeout=timeout)
    failures: list[str] = []
    if rank in members:
        root = rank == trainers[0]
        gen = torch.Generator().manual_seed(seed)
        # the rollout side is a serving engine, not a buffer: what it serves after each commit is checked
        engine, spec = None, None
        if engine_name == "reference":
            # the reference engine's own model (fp32) and bf16 tensors riding along as its extra buffers
            shapes = {
                "embed.weight": (512, 64),
                "layer.0.weight": (64, 64),
                "layer.0.bias": (64,),
                "scale": (),
            }
            extra = {n: TensorSpec(s, torch.bfloat16) for n, s in shapes.items()}
            spec = {**tiny_lm.checkpoint_spec(ModelConfig()), **extra}
            engine = None if root else ReferenceEngine(extra=extra, device=device)
        else:  # a named engine serves its own model: the first rollout rank tells everyone its tensors
            # an in-process vLLM would join this torchrun world (torch.distributed is initialised here)
            # instead of making its own: real vLLM runs as a server in a process of its own
            named = {"vllm": "vllm-server"}.get(engine_name, engine_name)
            engine = None if root else make_engine(named, None, device)
            announced = [
                {n: [list(t.shape), dtype_name(t.dtype)] for n, t in engine.weight_spec().items()}
                if rank == rollouts[0]
                else None
            ]
            dist.broadcast_object_list(announced, src=rollouts[0], group=group)
            spec = {n: TensorSpec(tuple(shape), dtype_from_name(d)) for n, (shape, d) in announced[0].items()}
        full = {n: torch.randn(s.shape, generator=gen).to(s.dtype) for n, s in sorted(spec.items())}
        # the patch lands in the bf16 embedding riding along, or a named engine's largest tensor (its embedding)
        target = (
            "embed.weight" if engine_name == "reference" else max(sorted(full), key=lambda n: full[n].numel())
        )
        patched = {n: t.clone() for n, t in full.items()}
        flat = patched[target].view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 100]  # ~1 % changed, as per step
        flat[idx] = torch.randn(len(idx), generator=gen).to(flat.dtype)

        def received(tensor: torch.Tensor) -> torch.Tensor:
            """The trainer's tensor on every member (the others start from zeros: only the fabric fills them)."""
            buf = tensor.to(device).clone() if root else torch.zeros_like(tensor, device=device)
            dist.broadcast(buf, src=trainers[0], group=group)
            return buf.cpu()

        def check(version: int, sent: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> None:
            if not root:
                wrong = Manifest.build(version, sent).wrong(held)
                failures.extend(
                    f"rank {rank} version {version}: {n} not bitwise equal: {first_difference(sent[n], held[n])}"
                    for n in wrong
                )

        def commit(version: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            """What the engine serves once `tensors` are committed as `version` (the trainer: what it sent)."""
            if root:
                return tensors
            engine.commit_weights(tensors, version)
            return {n: t.cpu() for n, t in engine.read_weights().items()}

        try:
            # version 1: every tensor whole; version 2: only the patch (indices, values), applied to what
            # the engine serves from version 1
            held = {name: received(tensor) for name, tensor in full.items()}
            if rank == corrupt_rank:  # a receiver that damages what it got: one bit of one element
                held[target].view(torch.uint8).view(-1)[7 * held[target].element_size()] ^= 1  # element 7
            served = commit(1, held)
            check(1, full, served)
            step("smoke: version 1 (every tensor whole) committed and checked")
            if rank == kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == hang_rank:
                os.kill(os.getpid(), signal.SIGSTOP)
            at, values = received(idx), received(flat[idx])
            patch = served[target].clone()
            patch.view(-1)[at] = values
            check(2, patched, commit(2, {target: patch}) if not root else patched)
            step("smoke: version 2 (~1% patch) committed and checked")
        finally:
            if engine is not None:
                engine.shutdown()
    return failures


def report_in(
    rank: int, world: int, payload: dict, deadline: float, tag: str = "smoke", stopped=lambda: None
) -> dict[int, dict]:
    """Every rank posts `payload` to the rendezvous store (not the process group, which a dead member
    breaks); rank 0 waits until `deadline` (time.monotonic) for all of them and returns {rank: payload} of
    those that came (the others return {}). A rank missing from the answer died or hung. `stopped()`: when
    a stop was asked (time.monotonic), or None; the wait then ends STOP_REPORT_S after it at the latest."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"validate-cluster/{tag}/{rank}", json.dumps(payload))
    if rank != 0:
        return {}
    keys = {r: f"validate-cluster/{tag}/{r}" for r in range(world)}
    waiting = set(keys)
    while waiting and time.monotonic() < min(deadline, (stopped() or math.inf) + STOP_REPORT_S):
        waiting = {r for r in waiting if not store.check([keys[r]])}
        if waiting:
            time.sleep(0.05)
    return {r: json.loads(store.get(keys[r])) for r in sorted(set(keys) - waiting)}


def verdict(
    links: list[Link], floor_gbs: float | None, smoke_failures: list[str], peer_share: float = 0.5
) -> tuple[str, list[str]]:
    """PASS, or FAIL with the reasons: every smoke failure; every link whose largest size ran below the floor;
    every point-to-point link below `peer_share` of its peers' median (one bad NIC or cable among good ones,
    with or without a rating). Links are named by both ends."""
    reasons = list(smoke_failures)
    largest: dict[tuple, Link] = {}
    for link in links:
        key = (link.kind, link.src, tuple(link.dst))
        if key not in largest or link.size_bytes > largest[key].size_bytes:
            largest[key] = link
    for link in largest.values():
        if floor_gbs is not None and link.gbs < floor_gbs:
            reasons.append(
                f"slow {link.kind} link {link.ends}: {link.gbs:.3f} GB/s at {link.size_bytes / 2**20:g} MiB, "
                f"below the floor {floor_gbs:.3f} GB/s"
            )
    p2p = sorted(link.gbs for link in largest.values() if link.kind == "p2p")
    if len(p2p) >= 3:
        median = p2p[len(p2p) // 2]
        for link in largest.values():
            if link.kind == "p2p" and link.gbs < peer_share * median:
                reasons.append(
                    f"slow p2p link {link.ends}: {link.gbs:.3f} GB/s at {link.size_bytes / 2**20:g} MiB, below "
                    f"{peer_share:g} x the median of its {len(p2p)} peers ({median:.3f} GB/s)"
                )
    return ("FAIL" if reasons else "PASS"), reasons


def table(links: list[Link], floor_gbs: float | None) -> str:
    rows = [f"{'kind':<10} {'src':>4} {'dst':<12} {'size (MiB)':>10} {'time (ms)':>10} {'GB/s':>9}  ends"]
    for link in links:
        slow = floor_gbs is not None and link.gbs < floor_gbs
        dst = ",".join(map(str, link.dst))
        rows.append(
            f"{link.kind:<10} {link.src:>4} {dst:<12} {link.size_bytes / 2**20:>10g} {link.time_s * 1e3:>10.3f} "
            f"{link.gbs:>9.3f}  {link.ends}{'  << below floor' if slow else ''}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.validate_cluster ...` under torchrun (harness.cli's validate-cluster is the same)."""
    from harness.cluster_args import parse

    argv = sys.argv[1:] if argv is None else argv
    return run(parse(argv), argv)


def run(a, argv: list[str], stoppable: bool = True) -> int:
    """One rank's validation, its arguments checked (harness.cluster_args.parse). `stoppable`: SIGINT or
    SIGTERM ends it within harness.stopping.STOP_BOUND_S (rank 0 writes what it has first)."""
    from harness.stopping import PromptStop

    state: dict = {"links": None, "command": "weightsync validate-cluster " + shlex.join(argv)}
    stop = PromptStop(STOP_GRACE_S, on_overrun=lambda signum: _write_stopped(a, state, signum))
    if not stoppable:
        return _validate(a, state, stop)
    with stop:
        return _validate(a, state, stop)


def _write_stopped(a, state: dict, signum: int) -> None:
    """Rank 0, stopped while it still waited: the report with what was measured, verdict STOPPED."""
    if state.get("rank") != 0 or state.get("written"):
        return
    why = f"stopped by {signal.Signals(signum).name} during {state.get('phase', 'the start')}"
    links = state["links"] or []
    data = {
        "verdict": "STOPPED",
        "command": state["command"],
        "reasons": [why],
        "world_size": state.get("world"),
    }
    data["links"] = [{**asdict(link), "gbs": link.gbs} for link in links]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validate-cluster.json").write_text(json.dumps(data, indent=2))
    print(f"{why}: {len(links)} measurements kept in {out / 'validate-cluster.json'}", flush=True)


def _validate(a, state: dict, stop) -> int:
    trainers, groups = a.trainer_ranks, a.rollout_ranks
    device_name = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_name.startswith("cuda") else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    state["phase"] = "the rendezvous (every rank must join)"
    dist.init_process_group(backend, timeout=timedelta(seconds=a.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    state["rank"], state["world"] = rank, world
    state["phase"] = "the link measurements"
    who: list = [None] * world
    dist.all_gather_object(who, _identity(rank, device))
    sizes = [int(s * 2**20) for s in a.sizes_mib]
    timeout = timedelta(seconds=a.timeout_s)
    n_pairs = len(trainers) * sum(map(len, groups))
    step = Steps(len(sizes) * (n_pairs + len(groups)) + 3, show=rank == 0)
    links = state["links"] = measure_links(trainers, groups, sizes, device, who, a.repeats, timeout, step)
    # one torchrun per node stops every local worker (SIGTERM, SIGKILL 30 s later) as soon as one dies: the
    # survivors finish the smoke and its report first (rank 0 waits STOP_REPORT_S at most once asked to stop),
    # so the verdict can name the dead rank
    stop.defer = True
    state["phase"] = "the smoke"
    t0 = time.monotonic()
    try:
        local = {
            "failures": smoke(
                trainers, groups, device, 0, a.kill_rank, a.hang_rank, a.corrupt_rank, timeout, step, a.engine
            )
        }
    except RuntimeError as exc:  # a peer that died or hung: gloo's "Connection closed by peer", or a timeout
        first = str(exc).splitlines()[0].split(". This is typically")[0]  # gloo appends advice and an emoji
        local = {"failures": [], "error": f"{type(exc).__name__}: {first[:300]}"}
    # a live rank's collective gives up timeout_s after it began (at the latest, timeout_s after the smoke
    # began plus the smoke's own few 100 ms), then it reports: rank 0 waits that long, and REPORT_GRACE_S more
    state["phase"] = "the smoke's reports"
    came = report_in(
        rank,
        world,
        local,
        max(time.monotonic(), t0 + a.timeout_s) + REPORT_GRACE_S,
        stopped=lambda: stop.stopped_at,
    )
    waited = time.monotonic() - t0
    step.done = step.total - 1  # a rank that died mid-smoke skipped steps: the last one is the report
    step(
        "every rank reported in"
        if rank != 0 or len(came) == world
        else f"{world - len(came)} rank(s) missing"
    )
    step.close()
    smoke_s = time.monotonic() - t0
    failures = [f for r in sorted(came) for f in came[r]["failures"]]
    failures += [f"{who[r]}: smoke raised {p['error']}" for r, p in came.items() if "error" in p]
    missing = sorted(set(range(world)) - set(came)) if rank == 0 else []
    failures += [
        f"{who[r]} did not report within {waited:.0f} s of the smoke's start: dead or hung" for r in missing
    ]
    healthy = not missing and not any("error" in p for p in came.values())
    floor = payload_gbs(a.rating_gbps) * a.floor if a.rating_gbps else None
    result, reasons = verdict(links, floor, failures, a.peer_share)
    if rank == 0:
        print(table(links, floor), flush=True)
        if floor is not None:
            print(
                f"floor: {a.floor:g} x {a.rating_gbps:g} Gb/s = {a.floor:g} x {payload_gbs(a.rating_gbps):.3f} GB/s "
                f"of payload = {floor:.3f} GB/s"
            )
        print(
            f"smoke: full update and ~1% patch into the {a.engine} engine on {sum(map(len, groups))} rollout "
            f"rank(s) in {smoke_s:.1f} s: "
            f"{'bitwise equal' if not failures else f'{len(failures)} failure(s)'}"
        )
        for reason in reasons:
            print(f"  {reason}")
        print(f"{result}: {len(links)} measurements, {len(reasons)} reason(s)", flush=True)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {
            "verdict": result,
            "command": state["command"],
            "reasons": reasons,
            "world_size": world,
            "trainer_ranks": trainers,
            "rollout_groups": groups,
            "rating_gbps": a.rating_gbps,
            "floor_gbs": floor,
            "timeout_s": a.timeout_s,
            "smoke_s": smoke_s,
            "missing_ranks": missing,
            "links": [{**asdict(link), "gbs": link.gbs} for link in links],
        }
        (out / "validate-cluster.json").write_text(json.dumps(data, indent=2))
        (out / "validate-cluster.html").write_text(render_validate_cluster(data))
        state["written"] = True
        print(f"report: {out / 'validate-cluster.json'}, {out / 'validate-cluster.html'}")
    if stop.stopped_at is not None and rank == 0:
        print(
            f"the launcher asked to stop {stop.stopped_at - t0:.1f} s into the smoke: stopped after the report"
        )
    # the verdict reaches every rank through the store too: after a death the process group cannot carry it
    state["phase"] = "sharing the verdict"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("validate-cluster/verdict", json.dumps({"verdict": result, "healthy": healthy}))
    else:
        try:
            store.wait(["validate-cluster/verdict"], timedelta(seconds=2 * a.timeout_s + 10))
            shared = json.loads(store.get("validate-cluster/verdict"))
            result, healthy = shared["verdict"], shared["healthy"]
        except RuntimeError:  # rank 0 (and with it the store's host) finished, or died: no verdict to share
            result, healthy = "FAIL", False
    if (
        healthy and stop.stopped_at is None
    ):  # a group with a dead member would hang here: leave it to the exit
        dist.barrier()
        dist.destroy_process_group()
    return EXIT_PASS if result == "PASS" else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
