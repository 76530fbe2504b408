"""The soak: many consecutive syncs on one deployment with a fault every N, each fault judged like a
matrix cell (harness.checks.judge_cell); trainer RSS, fds and threads before and after, and leaks."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import sys
import threading
import time
from pathlib import Path

from harness.api import Backend, Capabilities
from harness.checks import judge_cell
from harness.deployment import push
from harness.faults.cell import (
    DEFAULT_CELL_TIMEOUT_S,
    deploy_for_faults,
    leaked,
    next_step,
    read_engines,
    recover,
    seeded_weights,
    strike,
)
from harness.faults.injectors import FaultContext, PointNotApplicable
from harness.faults.kinds import FAULTS
from harness.paths.ipc import own_segments
from harness.registry import BUILTIN_BACKENDS, resolve_backend


def soak_backends() -> tuple[str, ...]:
    """The built-in paths whose Backend declares `soak` (each path says so in its own module)."""
    return tuple(name for name in BUILTIN_BACKENDS if resolve_backend(name, "cpu").soak)


#: The faults a soak cycles through, those of them that apply to the path (none that mounts): faults
#: during a push, and damage between syncs (harness.faults.between).
SOAK_FAULTS = (
    "receiver-kill",
    "shm-removed",
    "receiver-stall",
    "checkpoints-removed",
    "trainer-raise",
    "rank-killed-idle",
    "payload-corrupt",
    "shm-replaced",
    "payload-cut",
    "port-taken",
    "commit-fail",
)
WARMUP_SYNCS = 10


def _rss_mib() -> float:
    """Resident memory after a collection and malloc_trim: memory the allocator keeps for reuse after
    a burst (a fault's error path) is not a leak; what is still held after that is."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    gc.collect()  # a replaced rank's pipes close when its objects are collected: count what is still held
    return len(os.listdir("/proc/self/fd"))


def _fd_targets() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _applies(fault, backend_name: str, caps: Capabilities, dep) -> bool:
    return fault.applies_to(caps) is None and fault.applies(backend_name, caps, dep) is None


def run_soak(
    backend: Backend,
    backend_name: str,
    workdir: Path,
    syncs: int = 1000,
    fault_every: int = 20,
    engine: str | None = None,
    caps: Capabilities | None = None,
    timeout_s: float = DEFAULT_CELL_TIMEOUT_S,
    seed: int = 0,
) -> dict:
    """Push versions 1..syncs, consecutive trainer steps (a patch path sends patches); every
    `fault_every`-th push is struck by the next fault of SOAK_FAULTS that applies to the path, and the
    push after it is its recovery. Returns the report (JSON-able)."""
    caps = caps or backend.capabilities
    rng = random.Random(seed)
    segments_before = own_segments()
    dep = deploy_for_faults(backend, workdir, engine, timeout_s, caps)
    seen = {p.pid: p for p in dep.processes()}
    cells, clean_failures = [], []
    t_start = time.monotonic()
    baseline: dict[str, float] = {}
    steady: dict[str, float] = {}
    steady_fds: dict[str, str] = {}
    samples: list[dict] = []  # every 100 syncs: a leak is a slope, not one difference
    next_sample = 100
    kinds: list[str] = []
    try:
        kinds = [k for k in SOAK_FAULTS if _applies(FAULTS[k](), backend_name, caps, dep)]
        model = dep.handles[0].engine.weight_spec()
        committed = None  # weights of the newest version every engine holds
        weights = seeded_weights(model, seed * 100_003)
        v, n_faults = 1, 0
        while v <= syncs:
            if v == WARMUP_SYNCS + 1:
                baseline = {"rss": _rss_mib(), "fds": _fds(), "threads": threading.active_count()}
            tensors = weights = next_step(weights, seed * 100_003 + v)
            if v % fault_every == 0 and v < syncs and kinds:
                kind = kinds[n_faults % len(kinds)]
                n_faults += 1
                fault = FAULTS[kind]()
                weights = next_step(tensors, seed * 100_003 + v + 1)
                versions = {v: tensors, v + 1: weights}
                if committed is not None:
                    versions[v - 1] = committed
                ctx = FaultContext(dep, workdir, rng, segments_before=tuple(segments_before))
                try:
                    obs = strike(dep, fault, ctx, versions, v, timeout_s)
                except PointNotApplicable as exc:  # e.g. no segment kept (nothing to remove) this time
                    cells.append(
                        {"sync": v, "fault": kind, "verdict": "not_applicable", "reasons": [str(exc)]}
                    )
                    fault.teardown(ctx)
                    v += 1
                    continue
                recover(dep, obs, v + 1, ctx)
                seen.update({p.pid: p for p in dep.processes()})
                verdict, reasons = judge_cell(obs)
                cells.append(
                    {
                        "sync": v,
                        "fault": kind,
                        "point": fault.describe(ctx),
                        "verdict": verdict,
                        "reasons": reasons,
                        "error": obs.error_text(),
                        "detect_s": round(obs.detect_s, 3),
                        "recover_s": round(obs.recover_s, 3),
                    }
                )
                fault.teardown(ctx)
                committed = versions[v + 1] if obs.recovery_error is None else committed
                if n_faults == len(kinds):  # every fault path has run once: allocators are warm
                    steady = {"rss": _rss_mib(), "fds": _fds(), "threads": threading.active_count()}
                    steady_fds = _fd_targets()
                v += 2
                continue
            try:
                push(dep, v, tensors)
                committed = tensors
            except Exception as exc:  # noqa: BLE001 - a clean push that fails is a soak failure
                clean_failures.append(f"sync {v}: {type(exc).__name__}: {str(exc)[:300]}")
            if v >= next_sample:
                next_sample += 100
                samples.append(
                    {
                        "sync": v,
                        "rss_mib": round(_rss_mib(), 1),
                        "fds": _fds(),
                        "threads": threading.active_count(),
                    }
                )
                bad = sum(c["verdict"] != "ok" for c in cells)
                print(
                    f"soak {backend_name}: {v}/{syncs} syncs, {len(cells)} faults ({bad} not ok), "
                    f"{time.monotonic() - t_start:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
            v += 1
        final = read_engines(dep)
        wrong = [i for i, s in enumerate(final) if isinstance(s, str) or s[0] != syncs]
        end = {"rss": _rss_mib(), "fds": _fds(), "threads": threading.active_count()}
        end_fds = _fd_targets()
    finally:
        dep.close()
    leaks = leaked(seen.values(), workdir, segments_before)
    leaks += clean_failures
    if wrong:
        leaks.append(f"engines {wrong} do not serve the last version {syncs} at the end")
    ok = sum(c["verdict"] == "ok" for c in cells)
    judged = [c for c in cells if c["verdict"] != "not_applicable"]
    growth = {k: end[k] - baseline.get(k, end[k]) for k in end}
    steady_growth = {k: end[k] - steady.get(k, end[k]) for k in end}  # after the first round of faults
    return {
        "backend": backend_name,
        "syncs": syncs,
        "fault_every": fault_every,
        "timeout_s": timeout_s,
        "seconds": round(time.monotonic() - t_start, 1),
        "kinds": kinds,
        "cells": cells,
        "rss_start_mib": round(baseline.get("rss", 0), 1),
        "rss_end_mib": round(end["rss"], 1),
        "rss_growth_mib": round(growth["rss"], 1),
        "fds_growth": growth["fds"],
        "threads_growth": growth["threads"],
        "steady_rss_growth_mib": round(steady_growth["rss"], 1),
        "steady_fds_growth": steady_growth["fds"],
        "steady_threads_growth": steady_growth["threads"],
        "restarts": getattr(dep, "restarts", None),
        "leaks": leaks,
        "samples": samples,
        "fds_opened_since_steady": sorted(t for fd, t in end_fds.items() if steady_fds.get(fd) != t),
        "summary": f"{syncs} syncs, {len(judged)} faults of {len(kinds)} kinds, {ok} ok, {len(judged) - ok} not ok; RSS +{growth['rss']:.0f} MiB "
        f"(+{steady_growth['rss']:.0f} after the first round of faults), fds {growth['fds']:+d}, "
        f"threads {growth['threads']:+d}, restarts {getattr(dep, 'restarts', '?')}",
    }
