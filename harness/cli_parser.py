"""The `weightsync` command line's parser: certify, bench, cost and validate-cluster, each option with a
sentence of help and its default, each value checked as it is read (harness.cli_args). Imports no torch:
`--help` and a usage error answer at once."""

from __future__ import annotations

import argparse
import os

from harness import cli_args

#: certify's throughput rows: payload sizes (MiB) and repeats, and --quick's fewer
FULL_REPEATS = 3
QUICK_SIZES_MIB, QUICK_REPEATS = [64], 3  # one repeat failed the gate under load: a median needs three
#: Throughput sizes when none are named: from where the fixed cost dominates to where the bytes do (a bare
#: lifecycle row is added to them). A GPU moves 64 MiB in tens of microseconds: its sizes reach 4 GiB.
CPU_SIZES_MIB = FULL_SIZES_MIB = (1, 16, 64)
GPU_SIZES_MIB = (64, 1024, 4096)

DEVICE_HELP = (
    "where the trainer's weights and the engines live: cpu (default) or a GPU (cuda, cuda:0); on a GPU each "
    "built-in path runs its GPU variant, engines are built on that device, and throughput is gated against "
    "the GPU's verified ceiling (docs/performance.md)"
)
FLOOR_HELP = (
    "bandwidth floor of a path: the fraction of its verified ceiling's bandwidth it must reach, 0 < RATIO <= 1 "
    "(repeatable; default: what the backend declares, else its ceiling kind's in harness.bench.DEFAULT_FLOORS; "
    "see docs/performance.md)"
)
RESHARD_RANKS_HELP = (
    "the reshard backend's trainer (FSDP Shard(0)) ranks, each a process sending its rows per the plan "
    "(default 3; only with --backend reshard)"
)
RESHARD_TP_HELP = (
    "the reshard backend's tensor-parallel ranks per engine, the TP reference engine's M (default 2; it must "
    "split the engine's model: 1, 2 or 4; only with --backend reshard)"
)
BACKEND_HELP = "a built-in path name or pkg.module:factory (repeatable; default: every built-in path)"

CERTIFY_DESCRIPTION = """\
Certify backends against an engine: the conformance suite, the fault matrix and the throughput table, written
as reports/certify-<stamp>/ (results.json, junit.xml, report.md, report.html). Progress shows from the first
second: each suite part's tests done of those collected, and each backend's throughput rows, with an estimate
of what is left. How long (README): 10 min for every built-in path on the 2-core CI runner under load, --quick
2-3 min, 9 min on one H200. Ctrl-C or SIGTERM stops it within 10 s; --resume finishes the bundle."""

BENCH_DESCRIPTION = """\
Measure each path's sync throughput over a grid of sizes and receiver counts beside the raw transport's
ceiling, gate it by the bandwidth floors, and write reports/bench-<stamp>/ (results.json, report.md, plots).
Exit status: 0 PASS, 1 FAIL, 2 usage error (nothing ran), 3 a row missed on a busy host. Ctrl-C or SIGTERM
stops it within 10 s, writing the rows measured so far (verdict STOPPED)."""

sizes_mib = cli_args.whole(1, "MiB")
repeats = cli_args.whole(1, "repeats")


def build_parser(description: str, exits: str) -> argparse.ArgumentParser:
    """`weightsync` and its subcommands; `description` and `exits` (the exit statuses) come from the CLI's
    own docstring."""
    parser = argparse.ArgumentParser(
        prog="weightsync", description=description, epilog=exits, formatter_class=cli_args.HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_certify(sub, exits)
    add_bench(sub)
    add_cost(sub)
    sub.add_parser(
        "validate-cluster",
        help="under torchrun on every node: every trainer->rollout link and broadcast against the fabric's "
        "rating, a conformance smoke, a verdict (its own --help)",
        add_help=False,
    )
    return parser


def add_certify(sub, exits: str) -> None:
    c = sub.add_parser(
        "certify",
        help="run the conformance suite, the fault matrix and the throughput table; write a report bundle",
        description=CERTIFY_DESCRIPTION,
        epilog=exits,
        formatter_class=cli_args.HelpFormatter,
    )
    c.add_argument("--backend", action="append", help=BACKEND_HELP)
    c.add_argument(
        "--engine", default="reference", help="the engine factory: a built-in name or pkg.module:factory"
    )
    c.add_argument(
        "--receivers",
        default="auto",
        type=cli_args.receiver_counts,
        help="receiver counts for the multi-receiver tests: auto (2,3 where the path claims multi_receiver, "
        "else 1) or comma-separated counts such as 1,2",
    )
    c.add_argument(
        "--profile",
        default=os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE", "ci"),
        choices=["ci", "thorough"],
        help="the hypothesis profile of the property tests: ci (fewer examples) or thorough (many more; "
        "default: $WEIGHTSYNC_HYPOTHESIS_PROFILE, else ci)",
    )
    c.add_argument("--out", default="reports", help="the folder the report bundle is written under")
    c.add_argument(
        "--sizes-mib",
        type=sizes_mib,
        nargs="+",
        default=None,
        help=f"throughput payload sizes, MiB (default: {' '.join(map(str, FULL_SIZES_MIB))} on a CPU, "
        f"{' '.join(map(str, GPU_SIZES_MIB))} on a GPU cut to its memory; with --quick "
        f"{' '.join(map(str, QUICK_SIZES_MIB))}); a bare-lifecycle row (an empty payload) is added, and each "
        "path's time is fitted as fixed + bytes / bandwidth over them",
    )
    c.add_argument(
        "--repeats",
        type=repeats,
        default=None,
        help=f"timed repeats per throughput row, the median reported (default: {FULL_REPEATS}; with --quick "
        f"{QUICK_REPEATS})",
    )
    c.add_argument(
        "--quick",
        action="store_true",
        help="a first look: each fault's first point at one seed (the control column: its own faults), the "
        "conformance tests under a second (those marked not_quick are left out), each at the fewest "
        f"receivers, throughput at {' '.join(map(str, QUICK_SIZES_MIB))} MiB x {QUICK_REPEATS}; the report "
        "names what it left out and the command of the full run, and its verdict reads PASS (quick) (exit "
        "status as ever: 0)",
    )
    c.add_argument(
        "-j",
        "--jobs",
        default="auto",
        type=cli_args.jobs,
        help="pytest-xdist workers per suite: auto (default: min(cores // 2, 8) from 4 cores up, else 1), "
        "or N; 1 runs every test one at a time (no xdist). Tests marked serial (a deadline or a throughput "
        "against a bound) run after the rest, alone",
    )
    c.add_argument("--no-bench", action="store_true", help="skip the throughput table")
    c.add_argument(
        "--floor", action="append", default=[], type=cli_args.floor, metavar="PATH=RATIO", help=FLOOR_HELP
    )
    c.add_argument("--no-faults", action="store_true", help="skip the fault matrix (suites/faults)")
    c.add_argument(
        "--xfails-file",
        default=None,
        help="known failures of the code under test, one test id per line with '# reason' (as pytest's "
        "--weightsync-xfails-file): listed in the report as known, not failing the verdict; one that passes "
        "(fixed upstream) fails it (default: none)",
    )
    _reshard_options(c)
    c.add_argument("--device", default="cpu", type=cli_args.device, help=DEVICE_HELP)
    c.add_argument(
        "--resume",
        metavar="BUNDLE",
        default=None,
        help="finish a certify run that was stopped (a job's time limit, Ctrl-C): reopen its bundle folder, reuse "
        "each suite it finished and the throughput rows it measured, run what is missing, write the report "
        "there; the other arguments must be those of the run that began it (default: a new bundle)",
    )


def add_bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="throughput, breakdown and scaling tables with plots; gated by ratio floors",
        description=BENCH_DESCRIPTION,
        formatter_class=cli_args.HelpFormatter,
    )
    b.add_argument("--backend", action="append", help=BACKEND_HELP)
    b.add_argument(
        "--sizes-mib",
        type=sizes_mib,
        nargs="+",
        default=[16, 64, 256],
        help="payload sizes, MiB, each measured as one row (a bare-lifecycle row is added)",
    )
    b.add_argument(
        "--receivers",
        type=cli_args.whole(1, "receivers"),
        nargs="+",
        default=[1, 2, 3],
        help="receiver counts; a path that does not claim multi_receiver is measured at 1 only",
    )
    b.add_argument(
        "--delta-fractions",
        type=cli_args.number("a changed fraction", high=1.0),
        nargs="+",
        default=[0.001, 0.01, 0.05, 0.25, 0.5],
        help="changed fractions for delta paths (the crossover sweep: largest size, fewest receivers)",
    )
    b.add_argument(
        "--bucket-mib",
        type=cli_args.whole(1, "MiB"),
        nargs="+",
        default=[],
        metavar="MIB",
        help="bucket sizes to sweep, e.g. 16 64 256 1024: per path with buckets, at the largest size and "
        "the fewest receivers, over ~1 MiB tensors (default: no bucket sweep)",
    )
    b.add_argument("--repeats", type=repeats, default=5, help="timed repeats per row, the median reported")
    b.add_argument(
        "--engine",
        default="reference",
        help="engine factory of the receivers; it must take any bf16 payload",
    )
    b.add_argument(
        "--floor", action="append", default=[], type=cli_args.floor, metavar="PATH=RATIO", help=FLOOR_HELP
    )
    b.add_argument("--out", default="reports", help="the folder the bench bundle is written under")
    _reshard_options(b)
    b.add_argument("--device", default="cpu", type=cli_args.device, help=DEVICE_HELP)


def add_cost(sub) -> None:
    """`weightsync cost`; its options live in harness/cost.py, beside the arithmetic they feed."""
    from harness.cost import DESCRIPTION, add_arguments

    add_arguments(
        sub.add_parser(
            "cost",
            help="sync overhead per step and per run (GPU-hours, money); collocated vs disaggregated placement",
            description=DESCRIPTION,
            formatter_class=cli_args.HelpFormatter,
        )
    )


def _reshard_options(parser: argparse.ArgumentParser) -> None:
    """--trainer-ranks and --tp: the resharded sync's shape (certify and bench alike)."""
    parser.add_argument(
        "--trainer-ranks", type=cli_args.whole(1, "trainer ranks"), default=None, help=RESHARD_RANKS_HELP
    )
    parser.add_argument("--tp", type=cli_args.whole(1, "TP ranks"), default=None, help=RESHARD_TP_HELP)
