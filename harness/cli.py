"""weightsync command line.

    weightsync certify                      # every reference path -> reports/certify-<stamp>/
    weightsync certify --backend mypkg.sync:make_backend --engine reference
    weightsync certify --quick              # a first look: PASS (quick); the report names what it left out
    weightsync certify --jobs 8             # each suite on 8 pytest-xdist workers (default: from the cores)
    weightsync bench --backend broadcast --sizes-mib 16 64 256 --receivers 1 2 3   # -> reports/bench-<stamp>/
    weightsync cost --params 7e9 --results reports/.../results.json   # sync cost per step and placement advice
    torchrun --nproc-per-node=4 -m harness.cli validate-cluster --trainer-ranks 0 --rollout-ranks 1-3

Exit status of certify (bench: the same; its 3 is a row missed on a busy host):
  0  PASS              every piece of evidence was taken and none failed
  1  FAIL              a test, a fault cell or a throughput row (#wrong > 0, or below its floor) failed
  2  usage error       an unknown backend, engine or floor: nothing ran, no folder was written
  3  COULD NOT DECIDE  evidence is missing: a pytest run crashed, was killed or wrote no results, a fault
                       cell is unknown, the throughput could not be measured, a row missed its floors while
                       other jobs took half a CPU or more (measured: "host busy"), or nothing was shown
                       (every test NOT_SUPPORTED or skipped). Unknown is never reported as PASS.
The exit status and the verdict of results.json, report.md and report.html are one computed value
(harness.report.decide); every failure is printed with the command that reruns it alone.
"""

# Why one file: the commands share backend and engine resolution, the device, the exit statuses and the terminal;
# each command's work lives in its own module (bench, report, cost, validate_cluster): this is their wiring.

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.api import WeightSyncError
from harness.devices import check_available, set_run_device
from harness.registry import (
    BUILTIN_BACKENDS,
    BUILTIN_GPU_BACKENDS,
    EXTRA_BACKENDS,
    engine_capabilities,
    engine_path,
    resolve_backend,
)
from harness.suite_runs import SuiteArgs, finished_suite, run_suites, slug

console = Console(stderr=True, width=max(Console(stderr=True).width, 120))


def _suite_dir(name: str) -> Path:
    import suites

    return Path(suites.__file__).parent / name


#: certify's throughput rows: payload sizes (MiB) and repeats, and --quick's fewer
FULL_REPEATS = 3
QUICK_SIZES_MIB, QUICK_REPEATS = [64], 3  # one repeat failed the gate under load: a median needs three


def default_jobs() -> int:
    """certify's --jobs auto: pytest-xdist workers where there are cores for them, min(cores // 2, 8) from
    4 cores up (each worker's tests spawn rank processes of their own); 1 (serial, no xdist) below that."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores // 2, 8) if cores >= 4 else 1


def throughput_engine(name: str) -> tuple[str, str]:
    """The engine the throughput rows are measured with, as an import path, and a sentence that says so.
    The benchmark pushes seeded bf16 payloads of any size: an engine that serves only a fixed model
    (Capabilities.arbitrary_tensors false, e.g. vLLM) cannot take them, and the reference engine stands in."""
    import torch

    caps = engine_capabilities(name)
    if caps.arbitrary_tensors and torch.bfloat16 in caps.dtypes:
        return engine_path(name), f"throughput measured with the engine under test, {name}"
    return engine_path("reference"), (
        f"throughput measured with the reference engine; --engine {name} was not measured because it "
        "serves a fixed model and cannot take the benchmark's bf16 payloads of every size "
        "(its capabilities: arbitrary_tensors="
        f"{caps.arbitrary_tensors}, dtypes={sorted(str(d).removeprefix('torch.') for d in caps.dtypes)})"
    )


def certify(args: argparse.Namespace) -> int:
    from harness.bench import measure_sync, parse_floors
    from harness.report import EXIT_STATUS, write_report

    # Every name is resolved before anything runs: a typo is a usage error in seconds, with no report folder.
    try:
        floors = parse_floors(args.floor)
        backends = {name: resolve_backend(name) for name in args.backend}
        engine_caps = engine_capabilities(args.engine)  # the engine factory resolves and imports
        bench_engine, bench_note = throughput_engine(args.engine)
    except (ValueError, WeightSyncError) as exc:
        console.print(f"[red]usage error:[/] {exc}")
        return 2
    bench_engine_name = args.engine if bench_engine == engine_path(args.engine) else "reference"
    command = "weightsync " + shlex.join(args.argv)
    try:
        out, command = open_bundle(args, command)
    except ValueError as exc:
        console.print(f"[red]usage error:[/] {exc}")
        return 2
    names = list(backends)
    fault_names = [] if args.no_faults else names + (list(EXTRA_BACKENDS) if args.default_selection else [])
    # the suites first, side by side (what --resume finds finished is reused), the throughput rows alone after
    results = {n: d for n in names if (d := finished_suite(out, "conformance", n, console))}
    faults = {n: d for n in fault_names if (d := finished_suite(out, "faults", n, console))}
    ran = run_suites(
        [n for n in names if n not in results],
        [n for n in fault_names if n not in faults],
        SuiteArgs(args.engine, out, args.profile, args.receivers, args.xfails_file, args.quick),
        args.jobs,
        console,
    )
    results = {n: results.get(n) or ran[0][n] for n in names}
    faults = {n: faults.get(n) or ran[1][n] for n in fault_names}
    rows, missing = [], []
    for name, backend in backends.items():
        if not args.no_bench and (done := finished_rows(out, name)) is not None:
            rows += done
        elif not args.no_bench:
            limit = engine_caps.max_receivers if bench_engine_name == args.engine else 2
            rx = 2 if backend.capabilities.multi_receiver and limit >= 2 else 1
            t0 = time.monotonic()
            with console.status(f"[bold]throughput[/] {name}: {rx} receiver(s) ...") as status:
                try:
                    measured = measure_sync(
                        backend,
                        [s << 20 for s in args.sizes_mib],
                        rx,
                        repeats=args.repeats,
                        floors=floors,
                        progress=lambda msg: status.update(f"[bold]throughput[/] {msg}"),
                        engine=bench_engine,
                        bare=True,
                    )
                except Exception as exc:  # noqa: BLE001 - a measurement that raised is missing evidence
                    missing.append(f"throughput {name}: not measured ({type(exc).__name__}: {exc})")
                    console.print(
                        f"[red]throughput {name} raised:[/] {escape(f'{type(exc).__name__}: {exc}')}"
                    )
                else:
                    for row in measured:
                        row.backend = name  # the rerun line names the factory, not the display name
                    rows += measured
                    keep_rows(out, name, measured)
                    console.print(
                        f"throughput {name}: {len(measured)} rows ({rx} receiver(s)) in "
                        f"{time.monotonic() - t0:.0f}s",
                        highlight=False,
                    )
    report = write_report(
        out,
        results,
        rows,
        command,
        faults,
        engine=args.engine,
        receivers=args.receivers,
        profile=args.profile,
        repeats=args.repeats,
        throughput_engine=bench_engine_name,
        throughput_note=bench_note if rows else "" if args.no_bench else "throughput was not measured",
        missing=missing,
        jobs=args.jobs,
        quick={
            "full_command": full_run_command(args.argv),
            "sizes_mib": None if args.no_bench else args.sizes_mib,
            "repeats": None if args.no_bench else args.repeats,
        }
        if args.quick
        else None,
    )
    if rows:
        console.print(throughput_table(rows, bench_note))
        console.print(fit_table(rows))
    data = json.loads((out / "results.json").read_text())
    verdict = data["verdict"]
    for reason in data["reasons"]["failed"]:
        console.print(f"[red]failed:[/] {escape(reason)}", highlight=False)
    for reason in data["reasons"]["undecided"]:
        console.print(f"[yellow]could not decide:[/] {escape(reason)}", highlight=False)
    if data["reruns"]:
        console.print("[bold]rerun a failure alone[/] (from the repository root):")
        for rerun in data["reruns"]:
            console.print(f"  {rerun['command']}", highlight=False, markup=False, soft_wrap=True)
    colour = {"PASS": "green", "FAIL": "red"}.get(verdict, "yellow")
    if data["quick"]:
        console.print(
            f"--quick left out {data['quick']['total']} tests; the full run: {data['quick']['full_command']}",
            highlight=False,
            markup=False,
        )
    console.print(
        f"[bold {colour}]{escape(data['verdict_label'])}[/] (exit {data['exit_status']}) bundle: {out}/",
        highlight=False,
    )
    print(report)
    return EXIT_STATUS[verdict]


def full_run_command(argv: list[str]) -> str:
    """The certify command of the full run a --quick one stands for: its arguments less --quick (and less
    --resume, which reopens the quick run's own bundle)."""
    keep, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif arg != "--quick" and not arg.startswith("--resume="):
            keep.append(arg)
    return "weightsync " + shlex.join(keep)


#: What a resumed certify must share with the run that began the bundle: the same evidence, asked the same way.
RESUME_KEYS = ("backend", "engine", "receivers", "profile", "sizes_mib", "repeats", "no_bench", "floor")
RESUME_KEYS += ("no_faults", "xfails_file", "device", "quick")
#: A key a bundle of an earlier version did not write: the value its run had (there was no --quick then).
RESUME_DEFAULTS = {"quick": False}


def open_bundle(args: argparse.Namespace, command: str) -> tuple[Path, str]:
    """The bundle folder and the command the report names. A new run gets reports/certify-<stamp>/ and
    writes its arguments there (certify-args.json); `--resume DIR` reopens DIR, refuses arguments that differ
    from the run that began it (ValueError naming them), and returns the commands of every run so far."""
    mine = {key: getattr(args, key) for key in RESUME_KEYS}
    mine["xfails_file"] = mine["xfails_file"] and str(Path(mine["xfails_file"]).resolve())
    if not args.resume:
        out = Path(args.out) / f"certify-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "certify-args.json").write_text(json.dumps({"args": mine, "commands": [command]}, indent=2))
        return out, command
    out = Path(args.resume)
    try:
        began = json.loads((out / "certify-args.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume {out}: not a certify bundle ({type(exc).__name__}: {exc})") from None
    theirs = {k: began["args"].get(k, RESUME_DEFAULTS.get(k)) for k in RESUME_KEYS}
    differ = [k for k in RESUME_KEYS if theirs[k] != mine[k]]
    if differ:
        raise ValueError(
            f"--resume {out}: its run was asked differently, so its evidence is not this run's: "
            + "; ".join(f"{k}: {theirs[k]!r} there, {mine[k]!r} here" for k in differ)
        )
    began["commands"].append(command)
    (out / "certify-args.json").write_text(json.dumps(began, indent=2))
    return out, " ; then ".join(began["commands"])


def keep_rows(out: Path, backend: str, rows: list) -> None:
    """The throughput rows measured so far, kept in the bundle so a resumed run need not measure them again."""
    mine = [r.to_json() for r in rows]
    (out / f"throughput-{slug(backend)}.json").write_text(json.dumps(mine, indent=2))


def finished_rows(out: Path, backend: str) -> list | None:
    """A backend's throughput rows from an earlier run in this bundle; None where it measured none."""
    import dataclasses

    from harness.bench import SyncRow

    kept = out / f"throughput-{slug(backend)}.json"
    if not kept.exists():
        return None
    names = {f.name for f in dataclasses.fields(SyncRow)}
    rows = [SyncRow(**{k: v for k, v in r.items() if k in names}) for r in json.loads(kept.read_text())]
    console.print(f"throughput {backend}: {len(rows)} rows reused from this bundle's earlier run")
    return rows


def throughput_table(rows: list, note: str) -> Table:
    """The throughput rows as the terminal shows them; the title names the engine they were measured with."""
    from harness.bench import THROUGHPUT_COLUMNS, throughput_cells

    table = Table(title=f"sync throughput (median full lifecycle): {note}")
    for col in THROUGHPUT_COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*throughput_cells(r))
    return table


def fit_table(rows: list) -> Table:
    """Each path's fitted fixed cost and bandwidth beside its floors, as the terminal shows them."""
    from harness.throughput_model import FIT_COLUMNS, fit_cells, fit_paths

    fits = Table(title="fitted: time = fixed + bytes / bandwidth (against the verified ceiling)")
    for col in FIT_COLUMNS:
        fits.add_column(col, justify="right")
    for fit in fit_paths(rows):
        fits.add_row(*fit_cells(fit))
    return fits


def bench(args: argparse.Namespace) -> int:
    """The throughput table, its breakdown and the scaling tables over a grid of sizes and receiver
    counts (and changed fractions for delta paths, bucket sizes with --bucket-mib), gated like certify's,
    as reports/bench-<stamp>/."""
    from harness.bench import DEFAULT_CHANGED, measure_sync, parse_floors
    from harness.perf_report import write_perf_report

    try:
        floors = parse_floors(args.floor)
        backends = [resolve_backend(name) for name in args.backend]
        engine, note = throughput_engine(args.engine)
        if any(mib <= 0 for mib in args.bucket_mib):
            raise ValueError(
                f"--bucket-mib {args.bucket_mib}: every bucket size must be a positive MiB count"
            )
    except (ValueError, WeightSyncError) as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    if engine != engine_path(args.engine):
        console.print(f"[red]usage error:[/] {note}")
        return 2
    out = Path(args.out) / f"bench-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    sizes = [s << 20 for s in args.sizes_mib]
    rows = []
    for name, backend in zip(args.backend, backends, strict=True):
        first = len(rows)
        counts = [n for n in args.receivers if n == 1 or backend.capabilities.multi_receiver]
        for rx in counts:  # the delta sweep runs at the first receiver count only
            fractions = args.delta_fractions if backend.capabilities.delta and rx == counts[0] else [None]
            for fraction in fractions:
                done = len(rows)
                with console.status(f"[bold]bench[/] {backend.name} ...") as status:
                    rows += measure_sync(
                        backend,
                        sizes if fraction in (None, DEFAULT_CHANGED) else sizes[-1:],
                        rx,
                        repeats=args.repeats,
                        floors=floors,
                        fraction=fraction,
                        progress=lambda msg: status.update(f"[bold]bench[/] {msg}"),
                        engine=engine,
                        bare=fraction in (None, DEFAULT_CHANGED),
                    )
                _print_rows(rows[done:])
        if args.bucket_mib and not backend.capabilities.buckets:
            console.print(f"{backend.name}: no bucket sweep (it does not claim the buckets capability)")
        elif args.bucket_mib and counts:
            done = len(rows)
            rows += bucket_sweep(backend, max(sizes), min(counts), args, floors, engine)
            _print_rows(rows[done:])
        for row in rows[first:]:
            row.backend = name  # the rerun line names the factory, not the display name
    report = write_perf_report(out, rows, "weightsync " + shlex.join(args.argv))
    verdict = json.loads((out / "results.json").read_text())["verdict"]
    console.print(f"[bold {'green' if verdict == 'PASS' else 'red'}]{verdict}[/] report: {report}")
    print(report)
    return {"PASS": 0, "FAIL": 1}.get(verdict, 3)


#: The bucket sweep's payload is cut into tensors of about this size, so buckets matter: a bucket bigger
#: than a tensor packs several, a tensor bigger than a bucket goes whole.
SWEEP_TENSOR_BYTES = 1 << 20


def bucket_sweep(backend, size: int, rx: int, args: argparse.Namespace, floors, engine: str) -> list:
    """One row per --bucket-mib at the largest size and the fewest receivers, over a payload of
    ~1 MiB tensors (measured, not gated)."""
    from harness.bench import measure_sync

    rows = []
    for mib in args.bucket_mib:
        with console.status(f"[bold]bench[/] {backend.name} {mib} MiB buckets ...") as status:
            rows += measure_sync(
                backend,
                [size],
                rx,
                repeats=args.repeats,
                floors=floors,
                progress=lambda msg: status.update(f"[bold]bench[/] {msg}"),
                engine=engine,
                bucket_bytes=mib << 20,
                n_tensors=max(8, size // SWEEP_TENSOR_BYTES),
            )
    return rows


def _print_rows(rows: list) -> None:
    for r in rows:
        console.print(
            f"{r.path} {r.receivers}rx {r.size_bytes / 2**20:.0f} MiB"
            f"{f' {r.changed:.1%} changed' if r.changed else ''}"
            f"{f' {r.bucket_bytes / 2**20:g} MiB buckets' if r.bucket_bytes else ''}: {r.time_s * 1e3:.1f} ms, "
            f"ratio {r.ratio:.2f}, allowed {r.allowed_s * 1e3:.1f} ms ({r.verdict}), #wrong {r.wrong}"
        )


DEVICE_HELP = (
    "where the trainer's weights and the engines live: cpu (default) or a GPU (cuda, cuda:0); on a GPU each "
    "built-in path runs its GPU variant, engines are built on that device, and throughput is gated against "
    "the GPU's verified ceiling (docs/performance.md)"
)

#: Throughput sizes when none are named: from where the fixed cost dominates to where the bytes do (a bare
#: lifecycle row is added to them). A GPU moves 64 MiB in tens of microseconds: its sizes reach 4 GiB.
CPU_SIZES_MIB = FULL_SIZES_MIB = (1, 16, 64)
GPU_SIZES_MIB = (64, 1024, 4096)


def default_sizes_mib(device: str) -> list[int]:
    """The throughput sizes of a run on `device`: CPU_SIZES_MIB, or GPU_SIZES_MIB cut to what fits in a
    sixth of the GPU's free memory (the payload, the engines' copies, the ceiling's buffers)."""
    if device == "cpu":
        return list(CPU_SIZES_MIB)
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    fits = [s for s in GPU_SIZES_MIB if (s << 20) * 6 <= free]
    return fits if len(fits) >= 2 else list(GPU_SIZES_MIB[:2])


def default_backends(device: str) -> list[str]:
    """Every built-in path on the CPU; on a GPU, the GPU variants this host can run (the NCCL ones need a
    GPU per rank: at least two)."""
    if device == "cpu":
        return list(BUILTIN_BACKENDS)
    import torch

    one_gpu = torch.cuda.device_count() < 2
    return [n for n, path in BUILTIN_GPU_BACKENDS.items() if not (one_gpu and "nccl" in path)]


def add_cost_parser(sub) -> None:
    """`weightsync cost`; its options live in harness/cost.py, beside the arithmetic they feed."""
    from harness.cost import DESCRIPTION, add_arguments

    add_arguments(
        sub.add_parser(
            "cost",
            help="sync overhead per step and per run (GPU-hours, money); collocated vs disaggregated placement",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def cost(args: argparse.Namespace) -> int:
    """Exit 0 with the figures on stdout, 2 for a value the arithmetic cannot use (named)."""
    from harness.cost import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    usage, _, exits = __doc__.partition("Exit status")
    parser = argparse.ArgumentParser(
        prog="weightsync",
        description=usage,
        epilog="Exit status" + exits,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "certify",
        help="run the conformance suite, the fault matrix and the throughput table; write a report bundle",
        description="Certify backends against an engine; writes reports/certify-<stamp>/ (results.json, "
        "junit.xml, report.md, report.html).",
        epilog="Exit status" + exits,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument(
        "--backend",
        action="append",
        help="built-in name or pkg.module:factory (repeatable; default: every built-in path)",
    )
    c.add_argument("--engine", default="reference", help="engine factory (default: reference)")
    c.add_argument(
        "--receivers", default="auto", help="receiver counts for multi-receiver tests (default: auto)"
    )
    c.add_argument(
        "--profile", default=os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE", "ci"), choices=["ci", "thorough"]
    )
    c.add_argument("--out", default="reports", help="report directory (default: reports/)")
    c.add_argument(
        "--sizes-mib",
        type=int,
        nargs="+",
        default=None,
        help=f"throughput payload sizes, MiB (default: {' '.join(map(str, FULL_SIZES_MIB))} on a CPU, "
        f"{' '.join(map(str, GPU_SIZES_MIB))} on a GPU cut to its memory; with --quick "
        f"{' '.join(map(str, QUICK_SIZES_MIB))}); a bare-lifecycle row (an empty payload) is added, and each "
        "path's time is fitted as fixed + bytes / bandwidth over them",
    )
    c.add_argument(
        "--repeats", type=int, default=None, help=f"default {FULL_REPEATS}; with --quick {QUICK_REPEATS}"
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
        help="pytest-xdist workers per suite: auto (default: min(cores // 2, 8) from 4 cores up, else 1), "
        "or N; 1 runs every test one at a time (no xdist). Tests marked serial (a deadline or a throughput "
        "against a bound) run after the rest, alone",
    )
    c.add_argument("--no-bench", action="store_true", help="skip the throughput table")
    c.add_argument(
        "--floor",
        action="append",
        default=[],
        metavar="PATH=RATIO",
        help="bandwidth floor of a path: the fraction of its verified ceiling's bandwidth it must reach "
        "(repeatable; default: what the backend declares, else its ceiling kind's in "
        "harness.bench.DEFAULT_FLOORS; see docs/performance.md)",
    )
    c.add_argument("--no-faults", action="store_true", help="skip the fault matrix (suites/faults)")
    c.add_argument(
        "--xfails-file",
        default=None,
        help="known failures of the code under test, one test id per line with '# reason' (as pytest's "
        "--weightsync-xfails-file): listed in the report as known, not failing the verdict; one that passes "
        "(fixed upstream) fails it",
    )
    c.add_argument("--device", default="cpu", help=DEVICE_HELP)
    c.add_argument(
        "--resume",
        metavar="BUNDLE",
        default=None,
        help="finish a certify run that was stopped (a job's time limit): reopen its bundle folder, reuse "
        "each suite it finished and the throughput rows it measured, run what is missing, write the report "
        "there; the other arguments must be those of the run that began it",
    )
    b = sub.add_parser(
        "bench", help="throughput, breakdown and scaling tables with plots; gated by ratio floors"
    )
    b.add_argument(
        "--backend",
        action="append",
        help="built-in name or pkg.module:factory (default: every built-in path)",
    )
    b.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    b.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 3])
    b.add_argument(
        "--delta-fractions",
        type=float,
        nargs="+",
        default=[0.001, 0.01, 0.05, 0.25, 0.5],
        help="changed fractions for delta paths (the crossover sweep: largest size, fewest receivers)",
    )
    b.add_argument(
        "--bucket-mib",
        type=int,
        nargs="+",
        default=[],
        metavar="MIB",
        help="bucket sizes to sweep, e.g. 16 64 256 1024: per path with buckets, at the largest size and "
        "the fewest receivers, over ~1 MiB tensors (default: no bucket sweep)",
    )
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument(
        "--engine",
        default="reference",
        help="engine factory of the receivers; it must take any bf16 payload (default: reference)",
    )
    b.add_argument("--floor", action="append", default=[], metavar="PATH=RATIO")
    b.add_argument("--out", default="reports")
    b.add_argument("--device", default="cpu", help=DEVICE_HELP)
    add_cost_parser(sub)
    sub.add_parser(
        "validate-cluster",
        help="under torchrun on every node: every trainer->rollout link and broadcast against the fabric's "
        "rating, a conformance smoke, a verdict (harness.validate_cluster; its own --help)",
        add_help=False,
    )
    from_command_line = argv is None  # the command itself, not a caller's process (a test's main([...]))
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate-cluster"]:  # its options are its module's own (every rank parses them)
        from harness.validate_cluster import main as validate_cluster

        return validate_cluster(argv[1:])
    args = parser.parse_args(argv)
    args.argv = argv  # the report names the command as it was given
    if args.command == "cost":  # arithmetic only: no device, no suite
        return cost(args)
    if from_command_line:  # a supervisor's SIGTERM (`timeout`, a job's time limit)
        # unwinds like Ctrl-C, so a running suite is stopped and its hung test recorded
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        device = set_run_device(args.device)
        check_available(device)
    except ValueError as exc:
        console.print(f"[red]usage error:[/] {exc}")
        return 2
    if args.command == "bench":
        args.backend = args.backend or default_backends(device)
        return bench(args)
    if args.command == "certify":
        args.default_selection = not args.backend
        args.backend = args.backend or default_backends(device)
        try:
            args.jobs = default_jobs() if args.jobs == "auto" else int(args.jobs)
            if args.jobs < 1:
                raise ValueError
        except ValueError:
            console.print(
                f"[red]usage error:[/] --jobs {args.jobs}: 'auto' or a whole number of workers, 1 or more"
            )
            return 2
        args.sizes_mib = args.sizes_mib or (QUICK_SIZES_MIB if args.quick else default_sizes_mib(device))
        args.repeats = args.repeats or (QUICK_REPEATS if args.quick else FULL_REPEATS)
        return certify(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
