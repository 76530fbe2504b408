"""A trainer killed with SIGKILL mid-transfer: the trainer is a child process of the harness, killed
at a seeded tensor read of version 2 (while the manifest is built or while bytes move). Then:

- bounded: its rank processes end within 2x the timeout (none outlives the trainer);
- nothing leaks: no /dev/shm segment of the dead trainer, no visible version 2 (a partial checkpoint
  stays a temporary directory, never `v...2.*`);
- recovery: a new trainer on the same working directory sweeps what the dead one left, pushes versions
  1 and 2 again (a restarted trainer re-pushing v1 must not hit "already exists"), and every engine
  holds version 2 bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from harness.checks import bitwise_mismatches
from harness.deadline import Overran, PhaseWatch, phase_budget
from harness.deployment import push
from harness.faults.cell import (
    CELL_SPEC,
    N_RECEIVERS,
    CellResult,
    cell_versions,
    kill_ranks_of,
    unbounded_declaration,
    with_timeout,
)
from harness.faults.injectors import READ_POINTS, TrainerKill
from harness.paths.ipc import own_segments
from harness.registry import engine_capabilities, resolve_backend

KIND = TrainerKill.kind


class KillingTensors(Mapping):
    """The trainer's tensors; the k-th read kills the trainer's own process (SIGKILL: no cleanup runs)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], kill_at: int):
        self._tensors, self._kill_at, self._reads = tensors, kill_at, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        self._reads += 1
        if self._reads == self._kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _deploy(backend_name: str, workdir: Path, engine: str | None, timeout_s: float):
    backend = resolve_backend(backend_name)
    caps = backend.capabilities.restricted_by(engine_capabilities(engine))
    spec = CELL_SPEC if caps.arbitrary_tensors else None
    return with_timeout(backend, timeout_s).deploy(
        min(N_RECEIVERS, caps.max_receivers), spec, str(workdir), engine=engine
    )


def trainer_main(argv: list[str] | None = None) -> int:
    """The doomed trainer: deploy, push v1, say who its ranks are, die while pushing v2."""
    p = argparse.ArgumentParser(prog="python -m harness.faults.trainer_kill")
    p.add_argument("--backend", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--engine", default=None)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--point", default=None)
    a = p.parse_args(argv)
    dep = _deploy(a.backend, Path(a.workdir), a.engine, a.timeout)
    model = dep.handles[0].engine.weight_spec()
    versions = cell_versions(model, a.seed, 2)
    push(dep, 1, versions[1])
    n = len(model)  # a sender reads each tensor about twice: for the manifest, then to move it
    kill_at = READ_POINTS[a.point](n) if a.point in READ_POINTS else random.Random(a.seed).randint(1, 2 * n)
    print(
        json.dumps({"trainer": os.getpid(), "ranks": [r.pid for r in dep.processes()], "kill_at": kill_at}),
        flush=True,
    )
    push(dep, 2, KillingTensors(versions[2], kill_at))
    print(json.dumps({"survived": True}), flush=True)  # the kill point was never reached
    dep.close()
    return 0


def _wait_gone(pids: list[int], deadline: float) -> list[int]:
    """Wait (pidfd: no polling) until every pid has exited or the deadline passed; the survivors."""
    alive = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                alive.append(pid)
        finally:
            os.close(fd)
    return alive


def run_trainer_kill_cell(
    backend_name: str,
    seed: int,
    workdir: Path,
    engine: str | None,
    timeout_s: float,
    point: str | None = None,
) -> CellResult:
    result = CellResult(backend_name, KIND, seed, "unknown", [], timeout_s=timeout_s)
    unbounded = unbounded_declaration(resolve_backend(backend_name), timeout_s)
    if unbounded:  # as run_cell: failed by its declaration, nothing run
        result.verdict, result.reasons = "fail", [unbounded]
        return result
    argv = [
        sys.executable,
        "-m",
        "harness.faults.trainer_kill",
        "--backend",
        backend_name,
        "--workdir",
        str(workdir),
        "--timeout",
        str(timeout_s),
        "--seed",
        str(seed),
    ]
    if engine:
        argv += ["--engine", engine]
    if point in READ_POINTS:
        argv += ["--point", point]
    out, err = workdir / "trainer.out", workdir / "trainer.err"
    with (
        open(out, "w") as fo,
        open(err, "w") as fe,
    ):  # files, not pipes: a rank holding a pipe would delay wait()
        proc = subprocess.Popen(argv, stdout=fo, stderr=fe, text=True)
        budget = phase_budget("deploy", timeout_s) + 2 * phase_budget("push", timeout_s)
        try:
            returncode = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:  # its ranks end when its pipes close
            proc.kill()
            proc.wait()
            result.verdict = "fail"
            result.reasons = [
                f"trainer-kill: the doomed trainer's deploy and pushes overran their {budget:g} s budget "
                f"(killed): {(err.read_text() or out.read_text()).strip()[-600:]}"
            ]
            return result
    died_at = time.monotonic()
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    if returncode != -signal.SIGKILL or not lines or "ranks" not in lines[0]:
        result.reasons = [
            f"the trainer was not killed mid-push (exit {returncode}): "
            f"{(err.read_text() or out.read_text()).strip()[-600:]}"
        ]
        return result
    trainer, ranks = lines[0]["trainer"], lines[0]["ranks"]
    named = f" ({point})" if point in READ_POINTS else ""
    result.point = f"trainer SIGKILLed at tensor read {lines[0]['kill_at']}{named} of version 2"
    result.log = [f"trainer pid {trainer} killed; ranks {ranks}"]
    problems = []
    survivors = _wait_gone(ranks, died_at + 2 * timeout_s)
    result.detect_s = round(time.monotonic() - died_at, 3)
    if survivors:
        problems.append(
            f"rank processes {survivors} outlived the trainer by more than 2x the {timeout_s:g}s timeout"
        )
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
    visible = sorted(p.name for p in workdir.rglob("v0000000002.*"))
    if visible:
        problems.append(f"a partial version 2 is visible after the writer died: {visible}")
    t1 = time.monotonic()
    held: dict = {}

    def recovery(watch: PhaseWatch) -> None:
        """A new trainer on the same working directory: deploy, push 1 and 2, read every engine."""
        watch.phase("recovery")
        try:
            dep = held["dep"] = _deploy(backend_name, workdir, engine, timeout_s)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"no recovery: a new trainer could not deploy: {type(exc).__name__}: {exc}")
            return
        try:
            model = dep.handles[0].engine.weight_spec()
            weights = cell_versions(model, seed, 2)
            push(dep, 1, weights[1])
            push(dep, 2, weights[2])
            for i, h in enumerate(dep.handles):
                version, bad = (
                    h.engine.weight_version,
                    bitwise_mismatches(weights[2], h.engine.read_weights()),
                )
                if version != 2 or bad:
                    problems.append(f"after recovery engine {i} serves {version} ({bad[:1]})")
        except Overran:
            raise
        except Exception as exc:  # noqa: BLE001
            problems.append(
                f"no recovery: the new trainer's pushes failed: {type(exc).__name__}: {str(exc)[:400]}"
            )
        finally:
            watch.phase("cleanup")
            dep.close()
        left = [str(p) for p in workdir.rglob("*.tmp-*")]
        if left:
            problems.append(f"the dead writer's temporary directories were not swept: {left[:3]}")
        segments = own_segments(trainer)  # the new trainer must have released what the dead one held
        if segments:
            problems.append(
                f"/dev/shm segments of the dead trainer still there after a new trainer started: "
                f"{segments[:5]}"
            )

    watch = PhaseWatch(timeout_s, on_overrun=lambda: kill_ranks_of(held.get("dep")))
    overrun = watch.run(recovery)
    if overrun is not None:
        problems.insert(0, f"{KIND}: {overrun.describe()}")
        result.stacks = overrun.stacks
    elif watch.error is not None:
        raise watch.error
    result.recover_s = round(time.monotonic() - t1, 3)
    result.verdict, result.reasons = ("fail", problems) if problems else ("ok", [])
    return result


if __name__ == "__main__":
    sys.exit(trainer_main())
