"""Validate a cluster before a run: every trainer → rollout link and each rollout group's broadcast, measured
over the real fabric at sizes from 1 MiB up, judged against the rating the operator gives; then a short
conformance smoke (a full update and a sparse patch, each checked bit for bit on every rollout rank).

Launched with torchrun on every node (torchrun's rendezvous; the harness adds no launcher):

    torchrun --nproc-per-node=4 -m harness.validate_cluster --trainer-ranks 0 --rollout-ranks 1-3
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 -m harness.validate_cluster \\
        --trainer-ranks 0-7 --rollout-ranks 8-11 --rollout-ranks 12-15 --rating-gbps 400

Every rank measures; rank 0 prints the table and the verdict and writes `validate-cluster.json`. A link below
the floor (a fraction of the rating's payload rate) is named with both ends' hostnames and devices.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from harness.manifest import Manifest

#: Share of a link's raw rate that carries payload (framing, headers, flow control): 400 Gb/s NDR
#: = 50 GB/s raw, about 45 GB/s of payload.
PAYLOAD_SHARE = 0.9
EXIT_PASS, EXIT_FAIL = 0, 1


def parse_ranks(text: str) -> list[int]:
    """'0', '1-3', '0,2,4-5' → rank numbers; a ValueError naming the text otherwise."""
    ranks: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"rank range {text!r}: expected N, N-M or a comma-separated list of them")
        ranks += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return ranks


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


def measure_links(trainers, groups, sizes, device, who, repeats) -> list[Link]:
    """Every trainer → rollout pair point to point, then each group's broadcast from the first trainer.
    Every rank calls this (collectives need all of them); rank 0's list is the one reported."""
    rank = dist.get_rank()
    links: list[Link] = []
    pairs = [(t, r) for t in trainers for g in groups for r in g]
    # every rank creates every group, in the same order (new_group is collective)
    pair_groups = {pair: dist.new_group(list(pair)) for pair in pairs}
    cast_groups = [dist.new_group([trainers[0], *g]) for g in groups]
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
        for g, group in zip(groups, cast_groups):
            members = [trainers[0], *g]
            if rank in members:

                def cast(group=group, buf=buf):
                    dist.broadcast(buf, src=trainers[0], group=group)

                ends = f"{who[trainers[0]]} -> " + ", ".join(who[r] for r in g)
                links.append(
                    Link("broadcast", trainers[0], list(g), size, _timed(cast, group, repeats), ends)
                )
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


def smoke(trainers, groups, device, seed: int = 0) -> list[str]:
    """A full update, then a sparse patch, from the first trainer to every rollout rank over the fabric;
    each rollout rank checks every tensor bit for bit against the manifest's digests. Returns the
    failures (rank 0 gets everyone's)."""
    rank = dist.get_rank()
    rollouts = sorted(r for g in groups for r in g)
    members = [trainers[0], *rollouts]
    group = dist.new_group(members)
    failures: list[str] = []
    if rank in members:
        root = rank == trainers[0]
        gen = torch.Generator().manual_seed(seed)
        shapes = {"embed.weight": (512, 64), "layer.0.weight": (64, 64), "layer.0.bias": (64,), "scale": ()}
        full = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
        patched = {n: t.clone() for n, t in full.items()}
        flat = patched["embed.weight"].view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 100]  # ~1 % changed, as per step
        flat[idx] = torch.randn(len(idx), generator=gen).to(torch.bfloat16)

        def received(tensor: torch.Tensor) -> torch.Tensor:
            """The trainer's tensor on every member (the others start from zeros: only the fabric fills them)."""
            buf = tensor.to(device).clone() if root else torch.zeros_like(tensor, device=device)
            dist.broadcast(buf, src=trainers[0], group=group)
            return buf.cpu()

        def check(version: int, sent: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> None:
            if not root:
                wrong = Manifest.build(version, sent).wrong(held)
                failures.extend(f"rank {rank} version {version}: {n} not bitwise equal" for n in wrong)

        # version 1: every tensor whole; version 2: only the patch (indices, values), applied to what each
        # rank holds from version 1
        held = {name: received(tensor) for name, tensor in full.items()}
        check(1, full, held)
        at, values = received(idx), received(flat[idx])
        embed = held["embed.weight"].clone()
        embed.view(-1)[at] = values
        check(2, patched, {**held, "embed.weight": embed})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failures)
    return [f for per_rank in gathered for f in per_rank]


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
    p = argparse.ArgumentParser(prog="weightsync validate-cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer-ranks", required=True, help="the trainer's ranks: N, N-M or a list")
    p.add_argument(
        "--rollout-ranks", action="append", required=True, help="one rollout group's ranks (repeat per group)"
    )
    p.add_argument("--rating-gbps", type=float, default=None, help="the fabric's rating per link, in Gb/s")
    p.add_argument(
        "--floor", type=float, default=0.5, help="share of the rating's payload rate a link must reach"
    )
    p.add_argument(
        "--peer-share",
        type=float,
        default=0.5,
        help="a p2p link below this share of its peers' median is slow",
    )
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=".", help="where rank 0 writes validate-cluster.json")
    a = p.parse_args(argv)
    try:
        trainers = parse_ranks(a.trainer_ranks)
        groups = [parse_ranks(g) for g in a.rollout_ranks]
    except ValueError as exc:
        p.error(str(exc))
    backend = "nccl" if a.device.startswith("cuda") else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    named = sorted([*trainers, *(r for g in groups for r in g)])
    if len(set(named)) != len(named) or any(not 0 <= r < world for r in named):
        if rank == 0:
            print(
                f"usage error: trainer {trainers} and rollout groups {groups} must be distinct ranks of 0..{world - 1}"
            )
        dist.destroy_process_group()
        return 2
    who: list = [None] * world
    dist.all_gather_object(who, _identity(rank, device))
    sizes = [int(s * 2**20) for s in a.sizes_mib]
    links = measure_links(trainers, groups, sizes, device, who, a.repeats)
    failures = smoke(trainers, groups, device)
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
            f"smoke: full update and ~1% patch to {sum(map(len, groups))} rollout rank(s): "
            f"{'bitwise equal' if not failures else f'{len(failures)} failure(s)'}"
        )
        for reason in reasons:
            print(f"  {reason}")
        print(f"{result}: {len(links)} measurements, {len(reasons)} reason(s)", flush=True)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "validate-cluster.json").write_text(
            json.dumps(
                {
                    "verdict": result,
                    "reasons": reasons,
                    "world_size": world,
                    "trainer_ranks": trainers,
                    "rollout_groups": groups,
                    "rating_gbps": a.rating_gbps,
                    "floor_gbs": floor,
                    "links": [{**asdict(link), "gbs": link.gbs} for link in links],
                },
                indent=2,
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return EXIT_PASS if result == "PASS" else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
