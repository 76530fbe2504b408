"""The verdict and the evidence behind it: what each suite, fault cell and throughput row showed, the one
verdict computed from all of it (`decide`), the commands that rerun each failure alone, and the machine
that produced a run. Everything the Markdown and HTML pages draw from; it imports neither."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import shlex
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from harness.bench import busy_rows, judged_failed
from harness.report.counts import VERDICT_NAMES, rest_note

# test module -> the invariant of DESIGN.md it checks
INVARIANTS: dict[str, str] = {
    "test_bitwise": "1 bitwise (dtypes, shapes, NaN, -0.0)",
    "test_model_updates": "1 bitwise (model, trainer versions)",
    "test_buckets": "1 bitwise across buckets (tiny/unaligned units, oversize tensors, reuse)",
    "test_lifecycle_stateful": "3+5 version monotonicity, lifecycle order",
    "test_bad_input": "5 bad input refused, nothing lost",
    "test_pause_resume": "6 pause/resume, no mixing, nothing lost (queue beyond the batch)",
    "test_cache_invalidation": "4 caches invalidated (idle; under wait/keep traffic)",
    "test_computed_output": "1+4 computes like an independent forward (tied head; kept/waited tokens)",
    "test_in_place_load": "1+3 in-place load: rollback bit for bit, commit invalidates",
    "test_patch": "2 patch: base + delta exact (special values), wrong base / replay refused",
    "test_ipc_handles": "8 resources: handles released, stale/foreign refused",
    "test_resources": "8 resources: nothing grows with the number of syncs",
    "test_supervision": "7 dead or hung rank fails in bounded time",
    "test_torchrun": "broadcast rank code under torchrun",
    "test_reshard": "1 bitwise per TP shard (FSDP2/DTensor shards in, plan's minimum bytes)",
    "test_deploy": "deploys with what the backend claims (receivers, buckets, GPU)",
    "test_tp_engine": "4+6 TP engine: every rank on one version, forward equals one process, pause/resume",
}

#: What the leading numbers of INVARIANTS' names refer to: the invariants of docs/architecture.md
#: ("Invariants the suites check"), by number ("1+3": a module that checks invariants 1 and 3).
INVARIANT_NUMBERS: dict[int, str] = {
    1: "bitwise: every tensor read back equals the pushed version bit for bit",
    2: "patch: base + delta equals the next version bit for bit",
    3: "version: only moves forward, changes only at finish; stale or repeated refused",
    4: "no mixing: one version per request unless the pause mode says otherwise; caches invalidated",
    5: "lifecycle: calls out of order (and bad input) refused, the engine stays up",
    6: "pause/resume: abort, wait and keep lose no request",
    7: "faults: a dead or hung rank fails the sync in bounded time, the next sync succeeds",
    8: "resources: nothing leaks over many syncs",
}


#: Version of results.json's layout (docs/results-schema.md); bumped when a field changes meaning or goes.
SCHEMA_VERSION = 1


PASS, FAIL, UNDECIDED = "PASS", "FAIL", "COULD NOT DECIDE"


#: The exit status of `weightsync certify` for each verdict (2 is a usage error: nothing ran).
EXIT_STATUS = {PASS: 0, FAIL: 1, UNDECIDED: 3}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version_of(dist: str) -> str | None:
    """The installed version of a distribution, without importing it (vLLM's import takes seconds)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The machine and the software that produced a run (results.json's `environment`)."""
    env: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": _version_of("vllm"),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "gpus": [],
        "nccl": None,
    }
    if env["cuda"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):  # a build without NCCL
            env["nccl"] = None
    return env


@dataclasses.dataclass
class Decision:
    """The verdict and the evidence behind it: what failed, and what could not be established."""

    failed: list[str] = dataclasses.field(default_factory=list)
    undecided: list[str] = dataclasses.field(default_factory=list)

    @property
    def verdict(self) -> str:
        return FAIL if self.failed else UNDECIDED if self.undecided else PASS

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]


def known_failures(results: dict, faults: dict | None = None) -> list[tuple[str, str, str]]:
    """(backend, test, reason) of every strict xfail from an xfails file: failures of the code under test
    the user declared known. They do not fail the verdict; an XPASS (fixed, still listed) does."""
    return [
        (b, nodeid, rec.get("reason", ""))
        for suite in (results, faults or {})
        for b, res in suite.items()
        for nodeid, rec in res.get("tests", {}).items()
        if rec.get("status") == "xfailed"
    ]


def _judge_suite(label: str, res: dict, decision: Decision, must_show: bool) -> None:
    """One suite run (the results JSON of harness.pytest_plugin, one backend's as harness.suite_runs splits it)."""
    tests = res.get("tests", {})
    statuses = Counter(rec.get("status", "unknown") for rec in tests.values())
    for nodeid, rec in tests.items():
        status = rec.get("status", "unknown")
        cell = rec.get("fault_cell") or {}
        if status in ("failed", "error", "xpassed") or cell.get("verdict") == "fail":
            decision.failed.append(f"{label}: {nodeid} {status}")
        elif status == "unknown" or cell.get("verdict") == "unknown":
            decision.undecided.append(f"{label}: {nodeid} unknown (the outcome could not be established)")
        elif status == "missing_dependency":  # a check that could not run is not a pass
            why = (rec.get("message") or "").partition("MISSING_DEPENDENCY:")[2].strip()
            decision.undecided.append(
                f"{label}: {nodeid} could not run here: {why or 'a dependency is missing'}"
            )
    exitstatus = res.get("exitstatus", 0)
    if res.get("error"):
        decision.undecided.append(f"{label}: {res['error']}")
    elif not res.get("complete", True):
        decision.undecided.append(f"{label}: pytest stopped during {res.get('running') or 'teardown'}")
    elif exitstatus == 1 and not statuses["failed"] + statuses["error"]:
        decision.failed.append(f"{label}: pytest exited 1 with no test failed (an error in a teardown?)")
    elif exitstatus not in (0, 1, 5):
        decision.undecided.append(f"{label}: pytest exited {exitstatus} (interrupted or internal error)")
    if must_show and not res.get("error") and not statuses["passed"]:
        decision.undecided.append(
            f"{label}: nothing was shown (no test passed: {dict(statuses) or 'no tests'})"
        )


def decide(
    results: dict[str, dict],
    faults: dict[str, dict] | None = None,
    rows: list | None = None,
    missing: list[str] | tuple[str, ...] = (),
) -> Decision:
    """The verdict from every piece of evidence: conformance runs, fault runs, throughput rows, and
    `missing` (evidence that could not be taken, e.g. a throughput measurement that raised)."""
    decision = Decision()
    for backend, res in results.items():
        _judge_suite(f"conformance {backend}", res, decision, must_show=True)
    for backend, res in (faults or {}).items():
        _judge_suite(f"faults {backend}", res, decision, must_show=False)
    for r in rows or []:
        if judged_failed(r):
            decision.failed.append(
                f"throughput {r.path} {r.receivers}rx {r.size_bytes} B: {r.verdict} "
                f"(#wrong {r.wrong}, {r.time_s * 1e3:.2f} ms where {r.allowed_s * 1e3:.2f} ms is allowed: "
                f"fixed {r.fixed_allowed_s * 1e3:g} ms + verified ceiling time / floor {r.floor or '-'})"
            )
    from harness.throughput_model import fit_paths

    busy = {(r.path, r.receivers) for r in rows or [] if r.host_busy}
    for fit in fit_paths(rows or []):
        if (fit.path, fit.receivers) not in busy:
            decision.failed += [
                f"throughput {fit.path} {fit.receivers}rx fitted: {why}" for why in fit.failures()
            ]
    decision.undecided += busy_rows(rows or [])  # missed their floors while other jobs took the CPUs
    decision.undecided += list(missing)
    if not results and not faults and not rows:
        decision.undecided.append("no evidence: nothing was run")
    return decision


def pytest_rerun(
    nodeid: str,
    backend: str,
    engine: str,
    receivers: str,
    profile: str = "ci",
    seed: int | None = None,
    device: str = "cpu",
) -> str:
    """The command that reruns one test alone (run from the repository root, as certify runs it), on the
    device the suite ran on (its results' `device`)."""
    cmd = [
        "python",
        "-m",
        "pytest",
        nodeid,
        f"--weightsync-backend={backend}",
        f"--weightsync-engine={engine}",
        f"--weightsync-receivers={receivers}",
    ]
    if seed is not None:
        cmd.append(f"--weightsync-fault-seed={seed}")
    if profile != "ci":
        cmd.append(f"--weightsync-hypothesis-profile={profile}")
    if device and device != "cpu":
        cmd.append(f"--weightsync-device={device}")
    return shlex.join(cmd)


def bench_rerun(row: Any, engine: str = "reference", repeats: int = 3) -> str:
    """The `weightsync bench` command that remeasures one throughput row (SyncRow)."""
    cmd = [
        "weightsync",
        "bench",
        "--backend",
        row.backend or row.path,
        "--sizes-mib",
        str(max(1, round(row.size_bytes / 2**20))),
        "--receivers",
        str(row.receivers),
        "--repeats",
        str(repeats),
    ]
    if row.changed:
        cmd += ["--delta-fractions", f"{row.changed:g}"]
    if row.floor and row.floor_source.startswith("--floor"):
        cmd += ["--floor", f"{row.path}={row.floor:g}"]
    if engine != "reference":
        cmd += ["--engine", engine]
    if row.device != "cpu":
        cmd += ["--device", row.device]
    return shlex.join(cmd)


def reruns(
    results: dict[str, dict],
    faults: dict[str, dict],
    rows: list,
    engine: str,
    receivers: str,
    profile: str = "ci",
    repeats: int = 3,
    bench_engine: str | None = None,
) -> list[dict[str, str]]:
    """One rerun line per failed (or unknown) test and per failed throughput row (remeasured with
    `bench_engine`, the engine the rows were measured with; default `engine`)."""
    out = []
    for suite, runs in (("conformance", results), ("faults", faults)):
        for backend, res in runs.items():
            for nodeid, rec in res.get("tests", {}).items():
                cell = rec.get("fault_cell") or {}
                if rec.get("status") in ("failed", "error", "xpassed", "unknown") or cell.get("verdict") in (
                    "fail",
                    "unknown",
                ):
                    cmd = pytest_rerun(
                        nodeid,
                        backend,
                        engine,
                        receivers,
                        profile,
                        cell.get("seed"),
                        res.get("device", "cpu"),
                    )
                    out.append({"suite": suite, "what": f"{backend}: {nodeid}", "command": cmd})
    for r in rows:
        if not r.passed:
            what = f"{r.path} {r.receivers}rx {r.size_bytes} B ({r.verdict})"
            command = bench_rerun(r, bench_engine or engine, repeats)
            out.append({"suite": "throughput", "what": what, "command": command})
    return out


def invariant_of(nodeid: str) -> str:
    module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return INVARIANTS.get(module, module)


def matrix(results: dict[str, dict]) -> dict[str, dict[str, Counter]]:
    """invariant -> backend -> Counter of statuses."""
    out: dict[str, dict[str, Counter]] = {}
    for backend, res in results.items():
        for nodeid, rec in res.get("tests", {}).items():
            out.setdefault(invariant_of(nodeid), {}).setdefault(backend, Counter())[
                rec.get("status", "unknown")
            ] += 1
    return out


def cell(c: Counter | None) -> str:
    """An invariant × path cell: **FAIL** / unknown / PASS as a fraction of the tests, with what else its
    denominator holds ("PASS 12/13, 1 NOT_SUPPORTED"); NOT_SUPPORTED alone where nothing was claimed."""
    if not c:
        return "–"
    total = sum(c.values())
    failed = c.get("failed", 0) + c.get("error", 0) + c.get("xpassed", 0)
    if failed:
        shown = Counter({k: v for k, v in c.items() if k not in ("failed", "error", "xpassed")})
        return f"**FAIL** {failed}/{total}{rest_note(shown, '')}"
    if c.get("unknown"):
        return f"unknown {c['unknown']}/{total}{rest_note(c, 'unknown')}"
    if not c.get("passed") and c.get("not_supported") == total:
        return "NOT_SUPPORTED"
    return f"PASS {c.get('passed', 0)}/{total}{rest_note(c, 'passed')}"


def fault_matrix(faults: dict[str, dict]) -> dict[str, dict[str, list[dict]]]:
    """fault kind -> backend -> the cells (one per seed) from the fault suite's results JSON."""
    out: dict[str, dict[str, list[dict]]] = {}
    for backend, res in faults.items():
        for rec in res.get("tests", {}).values():
            c = rec.get("fault_cell")
            if c is None:
                continue
            c = {**c, "status": rec.get("status")}
            out.setdefault(c["fault"], {}).setdefault(backend, []).append(c)
    return out


def between_syncs_kinds(mat: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The kinds of a fault matrix that damage the deployment between syncs (rows of their own)."""
    return [
        k
        for k, row in mat.items()
        if any(c.get("family") == "between-syncs" for cs in row.values() for c in cs)
    ]


def damage_of(kind: str) -> str:
    """The first sentence of the fault kind's own description (what it does to the deployment): its class's
    docstring."""
    from harness.faults.kinds import FAULTS

    doc = FAULTS[kind].__doc__ if kind in FAULTS else None
    doc = doc or kind
    return " ".join(doc.split()).split(". ")[0].split(": ")[0].rstrip(".").replace("|", "/")


def fault_cell_text(cells: list[dict] | None) -> str:
    """ok / **FAIL** / unknown as a fraction of the cells, with what else the denominator holds ("ok 4/5,
    1 NOT_SUPPORTED"), and the worst time to detect and to recover; NOT_SUPPORTED alone where no cell
    applied."""
    if not cells:
        return "–"
    verdicts = Counter(c["verdict"] for c in cells)
    n = len(cells)
    if verdicts["fail"]:
        return f"**FAIL** {verdicts['fail']}/{n}{rest_note(verdicts, 'fail', VERDICT_NAMES)}"
    if verdicts["unknown"]:
        return f"unknown {verdicts['unknown']}/{n}{rest_note(verdicts, 'unknown', VERDICT_NAMES)}"
    if verdicts["not_applicable"] == n:
        return "NOT_SUPPORTED"
    detect = max(c["detect_s"] or 0 for c in cells)
    recover = max(c["recover_s"] or 0 for c in cells)
    return (
        f"ok {verdicts['ok']}/{n}{rest_note(verdicts, 'ok', VERDICT_NAMES)} ({detect:.1f}s / {recover:.1f}s)"
    )


#: The columns of a resharding plan's transfer table (report.md, report.html), keys of `reshard_plan`'s rows
RESHARD_COLUMNS = ("src", "dst", "source", "src_rows", "cols", "dest", "dst_rows", "bytes")

#: What each column of the transfer table holds (harness.reshard.plan.Transfer), as the pages define it.
RESHARD_COLUMN_MEANINGS = {
    "#": "the transfer's index in the plan",
    "src": "the trainer rank that sends",
    "dst": "the engine rank that receives",
    "source": "the trainer's tensor",
    "src_rows": "rows of the trainer rank's local shard read (start:end)",
    "cols": "its columns (start:end; all: every column)",
    "dest": "the engine's tensor (fused: qkv_proj, gate_up_proj)",
    "dst_rows": "rows of the engine rank's shard written (start:end)",
    "bytes": "bytes moved",
}


def reshard_plans(results: dict[str, dict]) -> list[tuple[str, str, dict]]:
    """(backend, test, plan record) for every test that attached a resharding plan (`reshard_plan`, from
    ReshardPlan.report_record) to its record; test_reshard does, with the bytes its sync measured."""
    return [
        (b, node, rec["reshard_plan"])
        for b, res in results.items()
        for node, rec in res.get("tests", {}).items()
        if rec.get("reshard_plan")
    ]


def reshard_heading(plan: dict) -> str:
    """One line: which ranks (and replicas), dtype, model, how many transfers, the data plane and why."""
    model = ", ".join(f"{k}={v}" for k, v in plan.get("model", {}).items())
    replicas = plan.get("replicas", 1)
    plane = f"; data plane: {plan['data_plane']} ({plan['data_plane_why']})" if plan.get("data_plane") else ""
    return (
        f"{plan['trainers']} trainer rank(s) -> {plan['engines']} engine rank(s)"
        + (f" x {replicas} replicas" if replicas > 1 else "")
        + f", {plan['dtype']}, {len(plan['transfers'])} transfers; model: {model}{plane}"
    )


def reshard_bytes_rows(plan: dict) -> list[list[str]]:
    """Bytes per rank as table cells: rank, planned, minimum, measured, and whether measured equals the
    minimum (engine ranks and total; a trainer rank has no minimum of its own)."""
    rows = []
    for r in plan["bytes"]:
        lo, got = r.get("minimum"), r.get("measured")
        ok = "-" if lo is None or got is None else "ok" if got == lo else f"off by {got - lo:+d} B"
        rows.append(
            [
                r["rank"],
                str(r["planned"]),
                "-" if lo is None else str(lo),
                "-" if got is None else str(got),
                ok,
            ]
        )
    return rows


def quick_skipped(results: dict, faults: dict | None = None) -> dict[str, dict[str, list[str]]]:
    """What certify --quick left out, by suite and backend: {"conformance": {backend: [node id]}, "faults":
    {...}} (the suites' quick_skipped: tests marked not_quick, fault cells past each fault's first point)."""
    return {
        suite: {b: sorted(res.get("quick_skipped", [])) for b, res in runs.items()}
        for suite, runs in (("conformance", results), ("faults", faults or {}))
    }


def verdict_label(verdict: str, quick: bool) -> str:
    """The verdict as the pages and the terminal print it: a --quick run's reads 'PASS (quick)' (its exit
    status is the verdict's own: 0 for PASS)."""
    return f"{verdict} (quick)" if quick else verdict


def jobs_text(jobs: int) -> str:
    """How the suites ran (certify --jobs), as the pages say it."""
    if jobs <= 1:
        return "suites run one test at a time (--jobs 1)"
    return f"suites run on {jobs} pytest-xdist workers each (--jobs {jobs}); tests marked serial after them, alone"


def quick_throughput(quick: dict) -> str:
    """'; the throughput was measured at 64 MiB, 1 repeat(s)' (nothing when no throughput was measured)."""
    if not quick.get("sizes_mib"):
        return ""
    return (
        f"; the throughput was measured at {' '.join(map(str, quick['sizes_mib']))} MiB, "
        f"{quick['repeats']} repeat(s)"
    )


def floor_notes(rows: list) -> list[tuple[str, str]]:
    """(path, text) once per gated path: its two floors, where they came from and why they are what they
    are ('bandwidth floor 0.03 of the verified ceiling, fixed cost 60 ms per sync (declared; fixed: default
    of memcpy): the host path stages ...'). A bundle from before floors carried their reason gets the
    default's reason where the floor was a default."""
    from harness.bench import DEFAULT_FLOOR_REASONS

    out: dict[str, str] = {}
    for r in rows:
        if not r.floor or r.swept or r.path in out:
            continue
        why = r.floor_reason
        if not why and r.floor_source.startswith("default of "):
            why = DEFAULT_FLOOR_REASONS.get(r.floor_source.removeprefix("default of ").partition(";")[0], "")
        why = why or "no reason recorded (a bundle written before floors carried their reason)"
        out[r.path] = (
            f"bandwidth floor {r.floor:g} of the verified ceiling, fixed cost {r.fixed_allowed_s * 1e3:g} ms "
            f"per sync ({r.floor_source or 'source not recorded'}): {why}"
        )
    return list(out.items())
