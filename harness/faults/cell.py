"""One cell of the fault matrix: a workload (push v1 clean, push v2 under the fault, heal, push v3),
then the checker's verdict (harness.checks.judge_cell). Jepsen's shape: client, nemesis, checker.

    result = run_cell(backend, "disk", "receiver-kill", seed=7, workdir=tmp)
    result.verdict   # "ok" | "fail" | "unknown" | "not_applicable", with the reasons
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from harness.api import Backend, Capabilities, RankInfo, TensorSpec
from harness.checks import CellObservation, judge_cell
from harness.deadline import Overran, PhaseWatch, over_bound
from harness.deployment import push
from harness.faults import engines as fault_engines
from harness.faults.injectors import (
    COMMIT_FAIL_DIR_ENV,
    PRIVATE_SHM_ENV,
    TRAINER_PROCESS,
    Fault,
    FaultContext,
    PointNotApplicable,
)
from harness.faults.kinds import FAULTS
from harness.faults.network import NETWORK
from harness.paths.ipc import own_segments
from harness.procs import pid_alive
from harness.registry import engine_path

#: Extra tensors every cell pushes beside the model: 8 MiB in 8 tensors, several buckets on every path.
CELL_SPEC = {f"fault.payload.{i}": TensorSpec((256, 1024), torch.float32) for i in range(8)}
#: (backend, receivers, engine) -> why its deployment failed, in this process: tried once per run.
_FAILED_DEPLOYS: dict[tuple[str, int, str | None], str] = {}
#: The unit a cell's data plane moves in where the backend takes one: the payload spans several, so
#: a fault can land between two.
CELL_BUCKET_BYTES = 1 << 20
DEFAULT_CELL_TIMEOUT_S = 4.0  # a stall is detected at 1.5x (6 s), the bound is 2x: room for a loaded CI host
N_RECEIVERS = 2


@dataclasses.dataclass
class CellResult:
    backend: str
    fault: str
    seed: int
    verdict: str
    reasons: list[str]
    point: str = ""
    family: str = "in-push"  # or "between-syncs": damage done while nothing synced (harness.faults.between)
    error: str | None = None
    detect_s: float | None = None  # the faulty push: until it returned
    recover_s: float | None = None  # the push after heal: until every engine held the new version
    timeout_s: float | None = None
    log: list[str] = dataclasses.field(default_factory=list)
    stacks: str = ""  # the cell's own stack when a phase overran its deadline

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def with_timeout(backend: Backend, timeout_s: float) -> Backend:
    """The backend with its declared timeout set to `timeout_s`, where it declares one."""
    if hasattr(backend, "timeout_s"):
        backend = copy.copy(backend)
        backend.timeout_s = timeout_s
    return backend


def seeded_weights(spec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (0.2 * torch.randn(s.shape, generator=gen)).to(s.dtype) for n, s in spec.items()}


#: The fraction of each tensor one optimizer step changes in a cell's versions (RL fine-tuning in bf16
#: changes ~1% of the entries per step): small enough that a patch path sends patches, not dense tensors.
STEP_FRACTION = 0.01


def next_step(weights: dict[str, torch.Tensor], seed: int, fraction: float = STEP_FRACTION):
    """The weights one trainer step later: `fraction` of each tensor's entries (at least one) changed."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        flat = w.detach().clone().reshape(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = (flat[idx].float() + 0.05 + 0.1 * torch.rand(k, generator=gen)).to(w.dtype)
        out[name] = flat.reshape(w.shape)
    return out


def cell_versions(spec, seed: int, n: int = 3) -> dict[int, dict[str, torch.Tensor]]:
    """A cell's versions 1..n: consecutive trainer steps (a small fraction changed each), so a patch
    path moves patches through the fault and has to handle a base that differs after it."""
    versions = {1: seeded_weights(spec, seed * 10 + 1)}
    for v in range(2, n + 1):
        versions[v] = next_step(versions[v - 1], seed * 10 + v)
    return versions


def deploy_for_faults(
    backend: Backend,
    workdir: Path,
    engine: str | None,
    timeout_s: float,
    caps: Capabilities,
    n_receivers: int = N_RECEIVERS,
):
    """A deployment whose engines can be told to fail a commit (harness.faults.engines), the backend's
    timeout set to `timeout_s`; the cell's extra tensors where the engine accepts any."""
    trigger_dir = workdir / "fault-triggers"
    trigger_dir.mkdir(parents=True, exist_ok=True)
    os.environ[COMMIT_FAIL_DIR_ENV] = str(trigger_dir)  # ranks are spawned with this environment
    os.environ[fault_engines.INNER_ENGINE_ENV] = engine_path(engine)
    spec = CELL_SPEC if caps.arbitrary_tensors else None
    n = min(n_receivers, caps.max_receivers)
    units = {"bucket_bytes": CELL_BUCKET_BYTES} if caps.buckets else {}  # a fault between two units
    return with_timeout(backend, timeout_s).deploy(
        n, spec, str(workdir), engine="harness.faults.engines:make_engine", **units
    )


def unbounded_declaration(backend: Backend, timeout_s: float) -> str | None:
    """Why `backend`, given `timeout_s`, fails the bounded verdict by what it declares (None: it does not)."""
    over = over_bound(with_timeout(backend, timeout_s), timeout_s)
    if not over:
        return None
    return (
        f"bounded: the backend declares {', '.join(over)}, over the cell's {timeout_s:g} s timeout "
        "(set with timeout_s): a stalled party would hold every sync that long"
    )


def kill_ranks_of(dep) -> None:
    """SIGKILL the rank processes of `dep` (None: nothing deployed yet): a phase overran its deadline."""
    for p in dep.processes() if dep is not None else []:
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGKILL)


def detached(exc: BaseException) -> BaseException:
    """The error without its tracebacks: kept in an observation, a traceback would hold this frame
    (and the observation) in a cycle, and every fault's tensors until a full garbage collection."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def strike(
    dep,
    fault: Fault,
    ctx: FaultContext,
    versions: dict,
    version: int,
    timeout_s: float,
    watch: PhaseWatch | None = None,
) -> CellObservation:
    """The nemesis' half of a cell: push `version` under `fault`, heal, read every engine. Raises only
    if the fault could not be set up (the cell is then unknown)."""
    enter = watch.phase if watch is not None else (lambda name: None)
    obs = CellObservation(fault=fault, timeout_s=timeout_s, versions=versions, version=version)
    enter("inject")
    fault.setup(ctx)
    tensors = fault.arm(ctx, versions[version])
    obs.must_name = tuple(fault.must_name)
    obs.victim_name = dep.processes()[ctx.victim].name if dep.processes() else None
    enter("push")
    t0 = time.monotonic()
    try:
        push(dep, version, tensors)
    except Exception as exc:  # noqa: BLE001 - the failure is what the checker judges
        obs.error = detached(exc)
    obs.detect_s = time.monotonic() - t0
    note_patch(ctx, dep, version)
    enter("heal")
    fault.disarm(ctx)
    ctx.join_timers()
    fault.heal(ctx)
    obs.after_fault = read_engines(dep)
    obs.fault_problems = fault.check(ctx)
    return obs


def note_patch(ctx: FaultContext, dep, version: int) -> None:
    """Into the cell's log: how a patch path sent `version` (patches or dense), so a reader sees that
    the cell exercised patches."""
    history = getattr(dep.sender, "history", None)
    if history:
        last = history[-1]
        ctx.note(
            f"version {version} prepared as {last.moved_bytes} of {last.dense_bytes} dense bytes "
            f"({last.dense_tensors} tensor(s) dense)"
        )


def recover(dep, obs: CellObservation, version: int, ctx: FaultContext | None = None) -> None:
    """The push after heal (no redeploy by hand), the fault's oracle after it (given `ctx`), and the
    final oracle read."""
    obs.recovery_version = version
    t1 = time.monotonic()
    try:
        push(dep, version, obs.versions[version])
    except Exception as exc:  # noqa: BLE001
        obs.recovery_error = detached(exc)
    obs.recover_s = time.monotonic() - t1
    if ctx is not None:
        note_patch(ctx, dep, version)
        obs.fault_problems = [*obs.fault_problems, *obs.fault.check_after_recovery(ctx)]
    obs.after_recovery = read_engines(dep)


def run_cell(
    backend: Backend,
    backend_name: str,
    fault_kind: str,
    seed: int,
    workdir: Path,
    engine: str | None = None,
    timeout_s: float = DEFAULT_CELL_TIMEOUT_S,
    caps: Capabilities | None = None,
    point: str | None = None,
) -> CellResult:
    """Run one cell and judge it, the fault struck at the named `point` (one of its Fault.points();
    None or 'seeded': drawn from the seed). Never raises for the system's faults: they are the verdict. Each phase
    (deploy, clean push, inject, push, heal, recovery, cleanup) runs under a deadline of its own
    (harness.deadline): a backend that blocks past it fails the cell, and the cell still ends."""
    caps = caps or backend.capabilities
    if (
        fault_kind == "storage-full"
        and caps.ipc
        and os.environ.get(PRIVATE_SHM_ENV) != "1"
        and os.geteuid() == 0
    ):
        return run_cell_in_private_shm(backend_name, fault_kind, seed, workdir, engine, timeout_s, point)
    fault = FAULTS[fault_kind]()
    if fault.family == TRAINER_PROCESS:
        raise ValueError(
            f"{fault_kind} kills the trainer itself: its cell is harness.faults.trainer_kill's "
            "(harness.faults.matrix.run_matrix_cell picks the cell of any kind)"
        )
    result = CellResult(
        backend_name, fault_kind, seed, "unknown", [], timeout_s=timeout_s, family=fault.family
    )
    reason = fault.applies_to(caps)
    if reason:
        result.verdict, result.reasons = "not_applicable", [reason]
        return result
    unbounded = unbounded_declaration(backend, timeout_s)
    if unbounded:  # failed by its declaration, nothing run
        result.verdict, result.reasons = "fail", [unbounded]
        return result
    segments_before = own_segments()  # the trainer's segments that are not this cell's (e.g. a suite's pool)
    seen: dict[int, RankInfo] = {}
    ctx = FaultContext(
        None, workdir, random.Random(seed), point=point, segments_before=tuple(segments_before)
    )  # type: ignore[arg-type] - deployed below
    held: dict[str, object] = {}

    n = min(N_RECEIVERS, caps.max_receivers)
    broken = _FAILED_DEPLOYS.get((backend_name, n, engine))
    if broken:  # the first cell that tried failed, by name: the others need not wait for it again
        result.verdict, result.reasons = "not_applicable", [f"broken: {broken}"]
        return result

    def body(watch: PhaseWatch) -> None:
        watch.phase("deploy")
        t0 = time.monotonic()
        try:
            dep = deploy_for_faults(backend, workdir, engine, timeout_s, caps)
        except Exception as exc:  # noqa: BLE001 - a claimed deployment that fails is a failure, once
            why = (
                f"{backend_name} deploys with {n} receiver(s) for fault injection: failed after "
                f"{time.monotonic() - t0:.1f} s: {type(exc).__name__}: {str(exc)[:600]}"
            )
            _FAILED_DEPLOYS[(backend_name, n, engine)] = why
            result.verdict, result.reasons = "fail", [why]
            return
        held["dep"] = ctx.deployment = dep
        try:
            _workload(dep, watch)
        finally:
            watch.phase("cleanup")
            try:
                dep.close()
            finally:
                fault.teardown(ctx)

    def _workload(dep, watch: PhaseWatch) -> None:
        reason = fault.applies(backend_name, caps, dep)
        if reason:
            result.verdict, result.reasons = "not_applicable", [reason]
            return
        model = dep.handles[0].engine.weight_spec()
        versions = cell_versions(model, seed)
        seen.update({p.pid: p for p in dep.processes()})
        watch.phase("clean push")
        try:
            push(dep, 1, versions[1])
        except Exception as exc:  # noqa: BLE001
            result.reasons = [
                f"the clean push of version 1 failed before any fault: {type(exc).__name__}: {exc}"
            ]
            return
        try:
            obs = strike(dep, fault, ctx, versions, 2, timeout_s, watch)
        except Overran:
            raise
        except PointNotApplicable as exc:
            result.verdict, result.reasons = "not_applicable", [str(exc)]
            return
        except Exception as exc:  # noqa: BLE001 - the nemesis could not act: unknown
            result.reasons = [f"the fault could not be set up: {type(exc).__name__}: {exc}"]
            return
        result.point = fault.describe(ctx)
        seen.update({p.pid: p for p in dep.processes()})
        watch.phase("recovery")
        recover(dep, obs, 3, ctx)
        seen.update({p.pid: p for p in dep.processes()})
        obs.push_waited_s = watch.waited_in("push")
        result.verdict, result.reasons = judge_cell(obs)
        result.error = obs.error_text()
        result.detect_s, result.recover_s = round(obs.detect_s, 3), round(obs.recover_s, 3)

    watch = PhaseWatch(timeout_s, on_overrun=lambda: kill_ranks_of(held.get("dep")))
    overrun = watch.run(body)
    result.log = ctx.log
    if overrun is not None:
        if not result.point and ctx.deployment is not None:
            result.point = fault.describe(ctx)
        result.verdict = "fail"
        result.reasons = [f"{fault_kind}: {overrun.describe()}", *result.reasons]
        result.stacks = overrun.stacks
        shutil.rmtree(workdir / "fault-triggers", ignore_errors=True)
        return result  # its ranks were killed: what is left is the overrun's doing, not a leak to judge
    if watch.error is not None:
        raise watch.error
    leaks = leaked(seen.values(), workdir, segments_before)
    if leaks and result.verdict in ("ok", "fail"):
        result.verdict = "fail"
        result.reasons.append("leaked after close: " + "; ".join(leaks))
    shutil.rmtree(workdir / "fault-triggers", ignore_errors=True)
    return result


def read_engines(dep) -> list[tuple[int, dict[str, torch.Tensor]] | str]:
    """Oracle read of every engine: (version, weights), or why it cannot serve (its rank is down)."""
    out = []
    for h in dep.handles:
        try:
            out.append((h.engine.weight_version, h.engine.read_weights()))
        except Exception as exc:  # noqa: BLE001 - a dead rank serves nothing; that is not a mix
            out.append(f"down: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return out


def leaked(ranks, workdir: Path, segments_before: Iterable[str] = ()) -> list[str]:
    """Processes, shared-memory segments and partial directories this cell created and left behind
    (segments this trainer held before the cell, e.g. a suite's open ipc deployments, are not its own)."""
    out = []
    alive = [r for r in ranks if pid_alive(r.pid)]
    if alive:
        out.append(f"rank processes still running: {[f'{r.name} pid {r.pid}' for r in alive]}")
    segments = sorted(set(own_segments()) - set(segments_before))
    if segments:
        out.append(f"/dev/shm segments of this trainer: {segments[:5]}")
    partial = [str(p) for p in workdir.rglob("*.tmp-*")]
    if partial:
        out.append(f"partial directories: {partial[:5]}")
    return out


PRIVATE_SHM_BYTES = 64 << 20


def run_cell_in_private_shm(
    backend_name: str,
    fault_kind: str,
    seed: int,
    workdir: Path,
    engine: str | None,
    timeout_s: float,
    point: str | None = None,
) -> CellResult:
    """The cell in a child process with a mount namespace of its own, whose /dev/shm is a fresh
    64 MiB tmpfs: the fault may fill it without touching the host's shared memory."""
    out = workdir / "cell.json"
    script = 'mount -t tmpfs -o size=$1 tmpfs /dev/shm && shift && exec "$@"'
    argv = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(PRIVATE_SHM_BYTES),
        sys.executable,
        "-m",
        "harness.faults.cell",
        "--backend",
        backend_name,
        "--fault",
        fault_kind,
        "--seed",
        str(seed),
        "--workdir",
        str(workdir),
        "--timeout",
        str(timeout_s),
        "--json",
        str(out),
    ]
    if engine:
        argv += ["--engine", engine]
    if point:
        argv += ["--point", point]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env={**os.environ, PRIVATE_SHM_ENV: "1"},
            check=False,
            timeout=20 * timeout_s + 120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CellResult(
            backend_name, fault_kind, seed, "unknown", [f"private /dev/shm: {exc}"], timeout_s=timeout_s
        )
    if not out.exists():
        why = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return CellResult(
            backend_name,
            fault_kind,
            seed,
            "unknown",
            [f"private /dev/shm cell exited {done.returncode} without a verdict: {why}"],
            timeout_s=timeout_s,
        )
    return CellResult(**json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.faults.cell --backend B --fault F --seed S --workdir W --json OUT`: one cell."""
    import argparse

    from harness.registry import resolve_backend

    p = argparse.ArgumentParser(prog="python -m harness.faults.cell", description=main.__doc__)
    p.add_argument("--backend", required=True)
    p.add_argument(
        "--fault",
        required=True,
        choices=sorted(k for k, f in FAULTS.items() if f.family not in (TRAINER_PROCESS, NETWORK)),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", required=True)
    p.add_argument("--engine", default=None)
    p.add_argument("--timeout", type=float, default=DEFAULT_CELL_TIMEOUT_S)
    p.add_argument("--json", required=True)
    p.add_argument("--point", default=None, help="a named fault point (Fault.points()); default: seeded")
    a = p.parse_args(argv)
    from harness.registry import engine_capabilities

    backend = resolve_backend(a.backend)
    caps = backend.capabilities.restricted_by(engine_capabilities(a.engine))
    result = run_cell(
        backend, a.backend, a.fault, a.seed, Path(a.workdir), a.engine, a.timeout, caps, a.point
    )
    Path(a.json).write_text(json.dumps(result.to_json()))
    print(f"{a.backend} x {a.fault} (seed {a.seed}): {result.verdict} {result.reasons}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
