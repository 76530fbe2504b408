"""validate-cluster's command line, read before torch is imported: its options, their checks (rank lists valid
and disjoint, within torchrun's world), and the refusal to run outside torchrun, which prints the torchrun line
to use, built from the arguments given. Every rank parses the same arguments and refuses the same way."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from harness import cli_args

DESCRIPTION = """\
Validate a cluster before a run: every trainer -> rollout link and each rollout group's broadcast over the real
fabric, judged against the rating you give, then a short conformance smoke (a full update and a ~1% patch,
checked bit for bit on every rollout rank). Rank 0 prints the table and the verdict and writes
validate-cluster.json and validate-cluster.html.

It runs one process per rank, launched by torchrun on every node (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR):

  torchrun --standalone --nproc-per-node=4 -m harness.cli validate-cluster --trainer-ranks 0 --rollout-ranks 1-3
  torchrun --nnodes=2 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 -m harness.cli validate-cluster \\
      --trainer-ranks 0-7 --rollout-ranks 8-11 --rollout-ranks 12-15 --rating-gbps 400

Exit status: 0 PASS, 1 FAIL (a slow link, a smoke failure, a rank lost), 2 usage error (nothing ran)."""

#: What torchrun sets in every worker's environment; validate-cluster needs them to join the world.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightsync validate-cluster", description=DESCRIPTION, formatter_class=cli_args.HelpFormatter
    )
    p.add_argument(
        "--trainer-ranks",
        required=True,
        type=cli_args.ranks,
        help="the trainer's ranks, as N, N-M or a comma-separated list (required)",
    )
    p.add_argument(
        "--rollout-ranks",
        action="append",
        required=True,
        type=cli_args.ranks,
        help="one rollout group's ranks, as --trainer-ranks takes them; repeat the option per group (required)",
    )
    p.add_argument(
        "--rating-gbps",
        type=cli_args.number("a link rating in Gb/s"),
        default=None,
        help="the fabric's rating per link in Gb/s, as vendors rate it (default: none, no floor; only the "
        "peer check judges the links)",
    )
    p.add_argument(
        "--floor",
        type=cli_args.number("a share of the rating", high=1.0),
        default=0.5,
        help="the share of the rating's payload rate every link must reach",
    )
    p.add_argument(
        "--peer-share",
        type=cli_args.number("a share of the peers' median", low_ok=True, high=1.0),
        default=0.5,
        help="a point-to-point link below this share of its peers' median is slow (0: no peer check)",
    )
    p.add_argument(
        "--sizes-mib",
        type=cli_args.number("a message size in MiB"),
        nargs="+",
        default=[1, 16, 256, 1024],
        help="message sizes measured on every link, in MiB",
    )
    p.add_argument(
        "--repeats", type=cli_args.whole(1, "repeats"), default=3, help="timed repeats per link and size"
    )
    p.add_argument(
        "--device",
        type=cli_args.device,
        default=None,
        help="where each rank's buffers live: cuda (rank i on its local GPU i, over NCCL) or cpu (gloo) "
        "(default: cuda where torch sees a GPU, else cpu)",
    )
    p.add_argument("--out", default=".", help="the folder rank 0 writes validate-cluster.json and .html to")
    p.add_argument(
        "--engine",
        default="reference",
        help="the rollout side's engine in the smoke: reference, vllm (real vLLM, a dev-mode server per "
        "rollout rank, serving its own model: the tensors sent are its shapes and dtypes) or pkg.module:factory",
    )
    p.add_argument(
        "--timeout-s",
        type=cli_args.number("seconds"),
        default=300,
        help="every collective gives up after this many seconds; a rank silent this long after the smoke "
        "is named dead",
    )
    faults = p.add_argument_group("fault injection (the harness's own tests)")
    rank = cli_args.whole(0, "a rank")
    faults.add_argument("--kill-rank", type=rank, default=None, help="this rank SIGKILLs itself mid-smoke")
    faults.add_argument("--hang-rank", type=rank, default=None, help="this rank SIGSTOPs itself mid-smoke")
    faults.add_argument(
        "--corrupt-rank", type=rank, default=None, help="this rank flips one bit of what it receives"
    )
    return p


def torchrun_line(argv: list[str]) -> str:
    """The single-node torchrun command for these arguments: one process per rank named (the highest + 1)."""
    parser = build_parser()
    try:
        args, _ = parser.parse_known_args(argv)
        named = [*args.trainer_ranks, *(r for g in args.rollout_ranks for r in g)]
        world = max(named) + 1
    except (SystemExit, TypeError, ValueError):
        world = 2
    launch = [
        "torchrun",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "harness.cli",
        "validate-cluster",
    ]
    return shlex.join([*launch, *argv])


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    """The arguments, checked: a usage error (exit 2) for a value refused, for rank lists that overlap or
    fall outside torchrun's world, and for a process torchrun did not start (with the line that would)."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    groups = [args.trainer_ranks, *args.rollout_ranks]
    seen: dict[int, int] = {}
    for i, group in enumerate(groups):
        for r in group:
            if r in seen:
                where = ["--trainer-ranks", *(["--rollout-ranks"] * len(args.rollout_ranks))]
                parser.error(
                    f"rank {r} is in {where[seen[r]]} {_text(groups[seen[r]])} and in {where[i]} "
                    f"{_text(group)}: the trainer and every rollout group must be disjoint"
                )
            seen[r] = i
    missing = [name for name in TORCHRUN_ENV if name not in environ]
    if missing:
        print(
            f"{parser.prog}: error: not launched by torchrun ({', '.join(missing)} not set): it runs one "
            "process per rank, started by torchrun on every node. On one node:\n\n"
            f"  {torchrun_line(argv)}\n\n"
            "On several nodes: torchrun --nnodes=N --nproc-per-node=GPUS --rdzv-endpoint=HOST:29500 on each "
            "(see --help).",
            file=sys.stderr,
        )
        raise SystemExit(2)
    world = int(environ["WORLD_SIZE"])
    outside = sorted(r for r in seen if r >= world)
    if outside:
        parser.error(
            f"ranks {outside} named, but torchrun started {world} process(es): ranks 0..{world - 1} "
            "(--trainer-ranks, --rollout-ranks)"
        )
    return args


def _text(group: list[int]) -> str:
    return ",".join(map(str, group))
