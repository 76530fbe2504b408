"""The links inside one node that a weight sync crosses before the fabric: host → device and device → host
(from pinned and from pageable host memory), device → device on one GPU, and GPU i → GPU j where a node
has several. Each measured at sizes from 1 MiB to 1 GiB, each copy checked bit for bit before it is timed,
and judged against a rating where the operator gives one (the host link's PCIe rating in Gb/s).

    python -m harness.node_links --device cuda --rating-host-gbps 512 --out reports/node-links

Writes node-links.json and node-links.md there. On a CPU-only host (`--device cpu`) only the host memory
copy is measured: the same code, so CI exercises it; its figures say nothing of a GPU node.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness.validate_cluster import PAYLOAD_SHARE, payload_gbs

SIZES_MIB = (1, 4, 16, 64, 256, 1024)
#: What judges a host link: measured GB/s against this share of the rating's payload rate.
DEFAULT_FLOOR_SHARE = 0.7


@dataclass
class NodeLink:
    link: str  # h2d-pinned, h2d-pageable, d2h-pinned, d2h-pageable, d2d, peer, host-memcpy
    src: str
    dst: str
    size_bytes: int
    times_s: list[float]

    @property
    def time_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def gbs(self) -> float:
        return self.size_bytes / self.time_s / 1e9


def _ends(device: torch.device) -> tuple[str, str]:
    host = f"{socket.gethostname()}:host"
    if device.type != "cuda":
        return host, host
    return host, f"{socket.gethostname()}:{device} ({torch.cuda.get_device_name(device)})"


def plan(device: torch.device) -> list[tuple[str, str, str, torch.device, torch.device, bool]]:
    """(link, src name, dst name, src device, dst device, pinned) for every link this node has."""
    host, gpu = _ends(device)
    cpu = torch.device("cpu")
    if device.type != "cuda":
        return [("host-memcpy", host, host, cpu, cpu, False)]
    links = [
        ("h2d-pinned", host, gpu, cpu, device, True),
        ("h2d-pageable", host, gpu, cpu, device, False),
        ("d2h-pinned", gpu, host, device, cpu, True),
        ("d2h-pageable", gpu, host, device, cpu, False),
        ("d2d", gpu, gpu, device, device, False),
    ]
    for j in range(torch.cuda.device_count()):  # other GPUs of the node, where there are any
        other = torch.device("cuda", j)
        if other != device:
            links.append(("peer", gpu, _ends(other)[1], device, other, False))
    return links


def _buffer(size: int, where: torch.device, pinned: bool, fill: int | None) -> torch.Tensor:
    if where.type == "cpu":
        t = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    else:
        t = torch.empty(size, dtype=torch.uint8, device=where)
    if fill is not None:  # random bytes: a dropped, shifted or zeroed range cannot keep them
        gen = torch.Generator().manual_seed(fill)
        t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
    return t


def _copy_time(dst: torch.Tensor, src: torch.Tensor) -> float:
    """One copy, timed to its end: CUDA events on the copying stream where a GPU is involved, else the clock."""
    if dst.is_cuda or src.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def measure(device: torch.device, sizes: list[int], repeats: int, warmup: int = 2, progress=print) -> list:
    """Every link at every size: checked bit for bit once, then `warmup` untimed and `repeats` timed copies.
    A copy that does not arrive intact raises (a wrong link has no bandwidth worth reporting)."""
    out: list[NodeLink] = []
    for link, src_name, dst_name, src_dev, dst_dev, pinned in plan(device):
        for size in sizes:
            src = _buffer(size, src_dev, pinned and src_dev.type == "cpu", fill=size)
            dst = _buffer(size, dst_dev, pinned and dst_dev.type == "cpu", fill=None)
            dst.copy_(src)
            if dst_dev.type == "cuda":
                torch.cuda.synchronize(dst_dev)
            if not torch.equal(dst.cpu(), src.cpu()):
                wrong = (dst.cpu() != src.cpu()).nonzero()
                raise RuntimeError(
                    f"{link} {src_name} -> {dst_name}, {size} B: {wrong.numel()} bytes differ after a copy, "
                    f"the first at offset {int(wrong[0])}"
                )
            for _ in range(warmup):
                _copy_time(dst, src)
            times = [_copy_time(dst, src) for _ in range(repeats)]
            out.append(NodeLink(link, src_name, dst_name, size, times))
            progress(f"{link:13} {size >> 20:>5} MiB  {out[-1].gbs:8.2f} GB/s")
            del src, dst
    return out


def judge(links: list[NodeLink], rating_host_gbps: float | None, share: float) -> list[str]:
    """The pinned host links (h2d, d2h: what a sync's staging uses) whose median rate at the largest size is
    below `share` of the rating's payload rate, each named with both ends; empty where no rating was given.
    Pageable copies are reported, not judged: they bounce through a staging buffer by design."""
    if not rating_host_gbps:
        return []
    floor = payload_gbs(rating_host_gbps) * share
    largest = max(link.size_bytes for link in links)
    return [
        f"{link.link} {link.src} -> {link.dst}: {link.gbs:.1f} GB/s at {largest >> 20} MiB, below the floor "
        f"{floor:.1f} GB/s ({share:g} x {payload_gbs(rating_host_gbps):.1f} GB/s of payload on a "
        f"{rating_host_gbps:g} Gb/s link)"
        for link in links
        if link.link in ("h2d-pinned", "d2h-pinned") and link.size_bytes == largest and link.gbs < floor
    ]


def table(links: list[NodeLink]) -> str:
    """One Markdown table, read at a glance: a row per link, a column per size (GB/s, median)."""
    sizes = sorted({link.size_bytes for link in links})
    names = list(dict.fromkeys((link.link, link.src, link.dst) for link in links))
    rate = {(link.link, link.src, link.dst, link.size_bytes): link.gbs for link in links}
    head = "| link | from | to | " + " | ".join(f"{s >> 20} MiB" for s in sizes) + " |"
    rows = [head, "| --- | --- | --- | " + " | ".join("--:" for _ in sizes) + " |"]
    for name in names:
        rows.append(
            f"| {name[0]} | {name[1]} | {name[2]} | "
            + " | ".join(f"{rate[(*name, s)]:.1f}" if (*name, s) in rate else "–" for s in sizes)
            + " |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.node_links", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=list(SIZES_MIB))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--rating-host-gbps",
        type=float,
        default=None,
        help="the host link's rating in Gb/s (PCIe Gen5 x16: 512); h2d/d2h below --floor-share of its "
        f"payload rate ({PAYLOAD_SHARE:g} of raw) are named",
    )
    p.add_argument("--floor-share", type=float, default=DEFAULT_FLOOR_SHARE)
    p.add_argument("--out", default="reports/node-links")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    links = measure(device, [s << 20 for s in args.sizes_mib], args.repeats)
    below = judge(links, args.rating_host_gbps, args.floor_share)
    verdict = "FAIL" if below else "PASS"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "verdict": verdict,
        "below_floor": below,
        "rating_host_gbps": args.rating_host_gbps,
        "floor_share": args.floor_share,
        "host": socket.gethostname(),
        "device": str(device),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "links": [{**asdict(link), "time_s": link.time_s, "gbs": link.gbs} for link in links],
    }
    (out / "node-links.json").write_text(json.dumps(data, indent=2))
    md = [
        f"# Links inside {data['host']}: {verdict}",
        "",
        f"GB/s (1e9 B/s), median of {args.repeats} copies after 2 untimed ones, each size checked bit for "
        "bit first; CUDA events on the copying stream.",
        "",
        table(links),
    ]
    md += ["", *(f"- below the floor: {b}" for b in below)] if below else []
    (out / "node-links.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
