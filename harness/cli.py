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
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.cli_parser import (
    CPU_SIZES_MIB,
    FULL_REPEATS,
    GPU_SIZES_MIB,
    QUICK_REPEATS,
    QUICK_SIZES_MIB,
)
from harness.progress import Progress
from harness.suite_runs import SuiteArgs, finished_suite, run_suites, slug

# torch and what imports it (harness.api, devices, registry) load inside the commands, after the arguments
# are checked: a usage error takes a fraction of a second, not the seconds torch takes to import.

console = Console(stderr=True, width=max(Console(stderr=True).width, 120))


def _suite_dir(name: str) -> Path:
    import suites

    return Path(suites.__file__).parent / name


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

    from harness.registry import engine_capabilities, engine_path

    caps = engine_capabilities(name)
    if caps.arbitrary_tensors and torch.bfloat16 in caps.dtypes:
        return engine_path(name), f"throughput measured with the engine under test, {name}"
    return engine_path("reference"), (
        f"throughput measured with the reference engine; --engine {name} was not measured because it "
        "serves a fixed model and cannot take the benchmark's bf16 payloads of every size "
        "(its capabilities: arbitrary_tensors="
        f"{caps.arbitrary_tensors}, dtypes={sorted(str(d).removeprefix('torch.') for d in caps.dtypes)})"
    )


def certify(args: argparse.Namespace, stop=None) -> int:
    """Every suite, the fault matrix and the throughput rows as one bundle and a verdict. Stopped (SIGINT,
    SIGTERM; `stop` a harness.stopping.PromptStop): the bundle keeps what finished, and the line that
    finishes it (--resume) is printed."""
    from harness.api import WeightSyncError
    from harness.bench import parse_floors
    from harness.registry import engine_capabilities, resolve_backend

    # Every name is resolved before anything runs: a typo is a usage error in seconds, with no report folder.
    try:
        floors = parse_floors(args.floor)
        backends = {name: resolve_backend(name) for name in args.backend}
        engine_caps = engine_capabilities(args.engine)  # the engine factory resolves and imports
        bench_engine, bench_note = throughput_engine(args.engine)
    except (ValueError, WeightSyncError) as exc:
        console.print(f"[red]usage error:[/] {exc}")
        return 2
    command = "weightsync " + shlex.join(args.argv)
    try:
        out, command = open_bundle(args, command)
    except ValueError as exc:
        console.print(f"[red]usage error:[/] {exc}")
        return 2

    def say_resume(signum: int | None = None) -> None:
        console.print(
            f"[yellow]stopped[/]: the bundle keeps what finished ({escape(str(out))}/); finish it with:",
            soft_wrap=True,
        )
        console.print(f"  {resume_command(args.argv, out)}", highlight=False, markup=False, soft_wrap=True)

    if stop is not None:
        stop.on_overrun = say_resume
    try:
        return certify_in(args, out, command, backends, floors, engine_caps, bench_engine, bench_note)
    except (SystemExit, KeyboardInterrupt):
        say_resume()
        raise


def certify_in(
    args, out: Path, command: str, backends: dict, floors, engine_caps, bench_engine, bench_note
) -> int:
    """certify once its bundle is open: the suites side by side, the throughput rows, the report."""
    from harness.registry import EXTRA_BACKENDS, engine_path
    from harness.report import EXIT_STATUS, write_report

    bench_engine_name = args.engine if bench_engine == engine_path(args.engine) else "reference"
    names = list(backends)
    fault_names = [] if args.no_faults else names + (list(EXTRA_BACKENDS) if args.default_selection else [])
    # the suites first, side by side (what --resume finds finished is reused), the throughput rows alone after
    results = {n: d for n in names if (d := finished_suite(out, "conformance", n, console))}
    faults = {n: d for n in fault_names if (d := finished_suite(out, "faults", n, console))}
    caps = [b.max_jobs for b in backends.values() if getattr(b, "max_jobs", None)]
    if caps and args.jobs > min(caps):
        console.print(f"xdist workers: {min(caps)}, not {args.jobs} (what the selected paths hold: max_jobs)")
        args.jobs = min(caps)
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
    with Progress(console) as progress:
        for name, backend in backends.items():
            if not args.no_bench and (done := finished_rows(out, name)) is not None:
                rows += done
            elif not args.no_bench:
                limit = engine_caps.max_receivers if bench_engine_name == args.engine else 2
                rx = 2 if backend.capabilities.multi_receiver and limit >= 2 else 1
                measured = measure_backend(name, backend, args, rx, floors, bench_engine, progress, missing)
                if measured is not None:
                    rows += measured
                    keep_rows(out, name, measured)
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
        f"[bold {colour}]{escape(data['verdict_label'])}[/] (exit {data['exit_status']}) bundle: {escape(str(out))}/",
        highlight=False,
        soft_wrap=True,
    )
    print(report)
    return EXIT_STATUS[verdict]


def measure_backend(
    name, backend, args, rx: int, floors, engine: str, progress, missing: list
) -> list | None:
    """certify's throughput rows of one backend (a bare-lifecycle row, then each size), shown as they go;
    None, with the reason added to `missing`, where the measurement raised."""
    from harness.bench import measure_sync
    from harness.registry import load_object

    if getattr(backend, "measure", None):  # a path the benchmark's payload does not fit measures itself
        measure_sync = load_object(backend.measure)
    task = f"throughput {name} ({rx} receiver(s))"
    total = len(args.sizes_mib) + 1
    progress.start(task, total, "rows", now="deploying", each_unit=True)
    t0 = time.monotonic()
    try:
        measured = measure_sync(
            backend,
            [s << 20 for s in args.sizes_mib],
            rx,
            repeats=args.repeats,
            floors=floors,
            progress=row_progress(progress, task, args.repeats),
            engine=engine,
            bare=True,
        )
    except Exception as exc:  # noqa: BLE001 - a measurement that raised is missing evidence
        missing.append(f"throughput {name}: not measured ({type(exc).__name__}: {exc})")
        progress.finish(task, f"throughput {name} raised: {type(exc).__name__}: {exc}")
        return None
    for row in measured:
        row.backend = name  # the rerun line names the factory, not the display name
    progress.finish(
        task, f"throughput {name}: {len(measured)} rows ({rx} receiver(s)) in {time.monotonic() - t0:.0f}s"
    )
    return measured


def row_progress(progress, task: str, repeats: int, first_row: int = 0):
    """measure_sync's progress callback as a task's progress: each message names a repeat, i/repeats; rows
    done count in fractions of a row as its repeats go."""
    seen = {"row": first_row - 1}

    def update(message: str) -> None:
        repeat = message.rpartition(", repeat ")[2]
        i = int(repeat.split("/")[0]) if repeat[:1].isdigit() else 1
        seen["row"] += i == 1  # every row begins with its first repeat
        progress.update(task, seen["row"] + (i - 1) / repeats, now=message)

    return update


def _without_resume(argv: list[str]) -> list[str]:
    """`argv` less its --resume BUNDLE (either spelling): that bundle is the run's own, not an argument of it."""
    keep, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            keep.append(arg)
    return keep


def full_run_command(argv: list[str]) -> str:
    """The certify command of the full run a --quick one stands for: its arguments less --quick (and less
    --resume, which reopens the quick run's own bundle)."""
    return "weightsync " + shlex.join(a for a in _without_resume(argv) if a != "--quick")


def resume_command(argv: list[str], out: Path) -> str:
    """The certify command that finishes the bundle `out`: the same arguments, --resume out."""
    return "weightsync " + shlex.join([*_without_resume(argv), "--resume", str(out)])


#: What a resumed certify must share with the run that began the bundle: the same evidence, asked the same way.
RESUME_KEYS = ("backend", "engine", "receivers", "profile", "sizes_mib", "repeats", "no_bench", "floor")
RESUME_KEYS += ("no_faults", "xfails_file", "device", "quick", "trainer_ranks", "tp")
#: A key a bundle of an earlier version did not write: the value its run had (there was no --quick then).
RESUME_DEFAULTS = {"quick": False, "trainer_ranks": None, "tp": None}


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


def bench(args: argparse.Namespace, stop=None) -> int:
    """The throughput table, its breakdown and the scaling tables over a grid of sizes and receiver
    counts (and changed fractions for delta paths, bucket sizes with --bucket-mib), gated like certify's,
    as reports/bench-<stamp>/. Stopped (SIGINT, SIGTERM; `stop` a harness.stopping.PromptStop): the rows
    measured so far are written as a partial bundle, its verdict STOPPED."""
    from harness.api import WeightSyncError
    from harness.bench import parse_floors
    from harness.perf_report import write_perf_report
    from harness.registry import engine_path, resolve_backend

    try:
        floors = parse_floors(args.floor)
        backends = [resolve_backend(name) for name in args.backend]
        engine, note = throughput_engine(args.engine)
    except (ValueError, WeightSyncError) as exc:
        console.print(f"[red]usage error:[/] {escape(str(exc))}")
        return 2
    if engine != engine_path(args.engine):
        console.print(f"[red]usage error:[/] {note}")
        return 2
    out = Path(args.out) / f"bench-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    command = "weightsync " + shlex.join(args.argv)
    rows: list = []
    written: list[Path] = []
    writing = threading.Lock()

    def write_partial(signum: int) -> None:
        """The rows measured so far as the bundle, once: the main thread unwinding, or the stop watcher when
        the main thread is still held (it waits a second for a write under way, not longer)."""
        if not writing.acquire(timeout=1.0):
            return
        try:
            if written:
                return
            written.append(out)
            why = f"stopped by {signal.Signals(signum).name} after {len(rows)} of {planned} rows"
            report = write_perf_report(out, list(rows), command, stopped=why)
            console.print(f"[yellow]{why}[/]; partial report: {escape(str(report))}", soft_wrap=True)
        finally:
            writing.release()

    if stop is not None:
        stop.on_overrun = write_partial
    planned = sum(len(plan) for plan in bench_plan(backends, args))
    try:
        with Progress(console) as progress:
            progress.start("bench", planned, "rows", now="deploying", each_unit=True)
            for name, backend, plan in zip(args.backend, backends, bench_plan(backends, args), strict=True):
                bench_backend(name, backend, plan, args, floors, engine, progress, rows)
            progress.finish("bench", f"bench: {len(rows)} rows measured")
    except SystemExit as exc:
        write_partial(exc.code - 128 if isinstance(exc.code, int) and exc.code > 128 else signal.SIGTERM)
        raise
    report = write_perf_report(out, rows, command)
    verdict = json.loads((out / "results.json").read_text())["verdict"]
    console.print(
        f"[bold {'green' if verdict == 'PASS' else 'red'}]{verdict}[/] report: {escape(str(report))}",
        soft_wrap=True,
    )
    print(report)
    return {"PASS": 0, "FAIL": 1}.get(verdict, 3)


def bench_plan(backends: list, args: argparse.Namespace) -> list[list[tuple]]:
    """Per backend, its rows in the order bench measures them: (receivers, changed fraction, sizes in bytes,
    bucket MiB or None). The delta sweep runs at the first receiver count only; the bucket sweep at the
    largest size and the fewest receivers, for a path that claims buckets."""
    from harness.bench import DEFAULT_CHANGED

    sizes = [s << 20 for s in args.sizes_mib]
    plans = []
    for backend in backends:
        caps = backend.capabilities
        counts = [n for n in args.receivers if n == 1 or caps.multi_receiver and n <= caps.max_receivers]
        plan = []
        for rx in counts:
            fractions = args.delta_fractions if backend.capabilities.delta and rx == counts[0] else [None]
            for fraction in fractions:
                full = fraction in (None, DEFAULT_CHANGED)
                plan += [
                    (rx, fraction, size, None)
                    for size in ([BARE] if full else []) + (sizes if full else sizes[-1:])
                ]
        if args.bucket_mib and backend.capabilities.buckets and counts:
            plan += [(min(counts), None, max(sizes), mib) for mib in args.bucket_mib]
        plans.append(plan)
    return plans


#: A bare-lifecycle row in a bench plan (measure_sync adds it where `bare`).
BARE = 0


def bench_backend(
    name: str, backend, plan: list[tuple], args, floors, engine: str, progress, rows: list
) -> None:
    """One backend's rows as planned (bench_plan), appended to `rows` one by one as each is measured (a stop
    writes those already there) and printed; `name` as the backend was named (the rerun line names it)."""
    from harness.bench import measure_sync
    from harness.registry import load_object

    if getattr(backend, "measure", None):  # a path the benchmark's payload does not fit measures itself
        measure_sync = load_object(backend.measure)
    if args.bucket_mib and not backend.capabilities.buckets:
        console.print(f"{backend.name}: no bucket sweep (it does not claim the buckets capability)")
    for rx, fraction, size, mib in plan:
        extra = {"bucket_bytes": mib << 20, "n_tensors": max(8, size // SWEEP_TENSOR_BYTES)} if mib else {}
        rows += measure_sync(
            backend,
            [] if size == BARE else [size],
            rx,
            repeats=args.repeats,
            floors=floors,
            fraction=fraction,
            progress=row_progress(progress, "bench", args.repeats, len(rows)),
            engine=engine,
            bare=size == BARE,
            **extra,
        )
        rows[-1].backend = name
        _print_rows(rows[-1:])


#: The bucket sweep's payload is cut into tensors of about this size, so buckets matter: a bucket bigger
#: than a tensor packs several, a tensor bigger than a bucket goes whole.
SWEEP_TENSOR_BYTES = 1 << 20


def _print_rows(rows: list) -> None:
    for r in rows:
        console.print(
            f"{r.path} {r.receivers}rx "
            f"{'bare lifecycle' if r.size_bytes < 2**20 else f'{r.size_bytes / 2**20:.0f} MiB'}"
            f"{f' {r.changed:.1%} changed' if r.changed else ''}"
            f"{f' {r.bucket_bytes / 2**20:g} MiB buckets' if r.bucket_bytes else ''}: {r.time_s * 1e3:.1f} ms, "
            f"ratio {r.ratio:.2f}, allowed {r.allowed_s * 1e3:.1f} ms ({r.verdict}), #wrong {r.wrong}"
        )


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
    from harness.registry import BUILTIN_BACKENDS, BUILTIN_GPU_BACKENDS

    if device == "cpu":
        return list(BUILTIN_BACKENDS)
    import torch

    one_gpu = torch.cuda.device_count() < 2
    return [n for n, path in BUILTIN_GPU_BACKENDS.items() if not (one_gpu and "nccl" in path)]


def cost(args: argparse.Namespace) -> int:
    """Exit 0 with the figures on stdout, 2 for a value the arithmetic cannot use (named)."""
    from harness.cost import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """`weightsync ...`: every argument is checked before anything runs (a usage error exits 2 at once, no
    folder written); run as the command itself, SIGINT and SIGTERM end it within harness.stopping.STOP_BOUND_S."""
    from harness.cli_parser import build_parser

    usage, _, exits = __doc__.partition("Exit status")
    parser = build_parser(usage, "Exit status" + exits)
    from_command_line = argv is None  # the command itself, not a caller's process (a test's main([...]))
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate-cluster"]:  # its options are its module's own (every rank parses them)
        from harness.cluster_args import parse

        cluster_args = parse(argv[1:])  # exits 2 outside torchrun, or for a value refused
        from harness.validate_cluster import run as validate_cluster

        return validate_cluster(cluster_args, argv[1:], stoppable=from_command_line)
    args = parser.parse_args(argv)
    args.argv = argv  # the report names the command as it was given
    if args.command == "cost":  # arithmetic only: no device, no suite
        return cost(args)
    if not from_command_line:
        return run_command(args)
    from harness.stopping import PromptStop

    with PromptStop() as stop:  # a supervisor's SIGTERM (`timeout`, a job's time limit) stops it like Ctrl-C
        return run_command(args, stop)


def run_command(args: argparse.Namespace, stop=None) -> int:
    """bench or certify, once the device is known to be there."""
    console.print(
        f"[progress] weightsync {args.command}: arguments checked; loading torch and the backends",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )  # the first second's line: torch takes seconds to import on a loaded host
    from harness.devices import check_available, set_run_device

    try:
        device = set_run_device(args.device)
        check_available(device)
    except ValueError as exc:
        console.print(f"[red]usage error:[/] {escape(str(exc))}")
        return 2
    # a factory path may be a reshard backend of someone's (or a broken one the meta tier certifies)
    reshard_like = [b for b in args.backend or [] if b == "reshard" or ":" in b]
    if (args.trainer_ranks or args.tp) and not reshard_like:
        console.print(
            "[red]usage error:[/] --trainer-ranks and --tp shape the reshard backend: add --backend reshard"
        )
        return 2
    from harness.backends.reshard import set_run_shape

    set_run_shape(
        args.trainer_ranks, args.tp
    )  # before any backend resolves: every suite's process inherits it
    if args.command == "bench":
        args.backend = args.backend or default_backends(device)
        return bench(args, stop)
    args.default_selection = not args.backend
    args.backend = args.backend or default_backends(device)
    args.jobs = default_jobs() if args.jobs == "auto" else args.jobs
    args.sizes_mib = args.sizes_mib or (QUICK_SIZES_MIB if args.quick else default_sizes_mib(device))
    args.repeats = args.repeats or (QUICK_REPEATS if args.quick else FULL_REPEATS)
    return certify(args, stop)


if __name__ == "__main__":
    sys.exit(main())
