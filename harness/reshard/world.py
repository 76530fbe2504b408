"""N trainer ranks and R engine replicas of M ranks each in one gloo world, started once and sent jobs:
each job builds both layouts and the plan once, then syncs `steps` versions with it over the job's data
plane (point to point, or broadcast per engine rank group) and judges every engine shard of every replica
against the oracle. Starting a world costs a second or so (N + M forks of harness.warm's server); a job on a
tiny model costs a fraction of one, so a property test sends many jobs to one world.

    with ReshardWorld(n_trainers=3, n_engines=2) as world:
        run = world.run(job(ModelShape(), api="fsdp2"))
        assert run.ok, run.summary()
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import signal
import time
import traceback
import uuid
from typing import Self

import torch
import torch.distributed as dist

from harness import warm
from harness.checks import bitwise_mismatches
from harness.procs import describe_exit
from harness.reshard.layout import ModelShape, engine_layout, full_weights, trainer_layout
from harness.reshard.oracle import expected_engine_shards
from harness.reshard.plan import ReshardPlan, build_plan
from harness.reshard.sync import (
    BROADCAST,
    WIRE_PLANES,
    EngineShards,
    broadcast_shards,
    choose_data_plane,
    rank_groups,
    receive_broadcast_shards,
    receive_shards,
    send_shards,
)
from harness.reshard.trainer_shards import DTENSOR, FSDP2, trainer_shards


def job(
    model: ModelShape,
    api: str = FSDP2,
    dtype: str = "bfloat16",
    seed: int = 0,
    steps: int = 2,
    plan: ReshardPlan | None = None,
    kill: tuple[str, int, int] | None = None,
    plane: str = "auto",
) -> dict:
    """A job for ReshardWorld.run: `plan` replaces the one the ranks would build (the meta tests' broken
    plans); `kill` = ("trainer", r, i): trainer rank r SIGKILLs itself before its i-th send of the first
    step; ("engine", r, i): engine rank r (counted across replicas) once it has received i transfers
    (point to point). `plane`: "p2p", "broadcast", or "auto" (choose_data_plane for the world's replicas)."""
    if plane != "auto" and plane not in WIRE_PLANES:
        raise ValueError(f"data plane {plane!r}: one of {WIRE_PLANES} or 'auto'")
    return {
        "model": dataclasses.asdict(model),
        "api": api,
        "dtype": dtype,
        "seed": seed,
        "steps": steps,
        "plan": plan.to_json() if plan is not None else None,
        "kill": kill,
        "plane": plane,
    }


def plan_of(job: dict, n: int, m: int) -> ReshardPlan:
    """The plan every rank of a world builds for `job` (the same on every rank: it is deterministic)."""
    if job.get("plan"):
        return ReshardPlan.from_json(job["plan"])
    model = ModelShape(**job["model"])
    return build_plan(
        trainer_layout(model, n, job["dtype"], replicate_norms=job["api"] == DTENSOR), engine_layout(model, m)
    )


@dataclasses.dataclass
class WorldRun:
    """What every rank reported for one job; `dead` ranks' exit, `silent` ranks that did not answer."""

    n: int
    m: int
    reports: dict[int, dict]
    dead: dict[int, str]
    silent: list[int]
    seconds: float
    replicas: int = 1

    def name(self, world_rank: int) -> str:
        if world_rank < self.n:
            return f"trainer rank {world_rank}"
        replica, rank = divmod(world_rank - self.n, self.m)
        return f"engine rank {rank}" + (f" of replica {replica}" if self.replicas > 1 else "")

    @property
    def plane(self) -> str | None:
        """The data plane the job ran on (what the ranks reported)."""
        return next((rep["plane"] for rep in self.reports.values() if rep.get("plane")), None)

    @property
    def ok(self) -> bool:
        return not self.dead and not self.silent and not self.problems()

    def problems(self) -> list[str]:
        out = []
        for r, rep in sorted(self.reports.items()):
            if rep.get("error"):
                out.append(f"{self.name(r)}: {rep['error']}")
            for s, step in enumerate(rep.get("steps", [])):
                out += [f"{self.name(r)} step {s}: {p}" for p in step["problems"]]
        return out

    def measured_bytes(self, step: int = 0) -> dict[str, int]:
        """{"trainer i" / "engine j" (with replicas: "engine j of replica q"): bytes the rank sent /
        received in step `step`}"""
        return {
            self.name(r).replace(" rank", ""): rep["steps"][step]["bytes"]
            for r, rep in sorted(self.reports.items())
            if len(rep.get("steps", [])) > step
        }

    def summary(self) -> str:
        replicas = f" x {self.replicas} replicas" if self.replicas > 1 else ""
        lines = [f"{self.n} trainer -> {self.m} engine ranks{replicas} ({self.plane}), {self.seconds:.2f}s"]
        lines += [f"  {self.name(r)} died: {how}" for r, how in self.dead.items()]
        lines += [f"  {self.name(r)} gave no answer" for r in self.silent]
        probs = self.problems()
        lines += [f"  {p}" for p in probs[:12]]
        if len(probs) > 12:
            lines.append(f"  ... and {len(probs) - 12} more")
        return "\n".join(lines)


def _rank_main(
    rank: int, n: int, m: int, replicas: int, port: int, prefix: str, jobs, reports, timeout_s: float
) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    size = n + replicas * m
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=size, timeout=timeout
    )
    # the broadcast plane's groups, made by every rank in the same order before any other group (a group
    # is named by how many the rank made before it, and the trainer ranks' mesh below is one the engine
    # ranks do not make)
    groups = {
        (s, d): dist.new_group(members) for s, d, members in rank_groups(n, m, replicas) if replicas > 1
    }
    mesh = None
    if rank < n:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", list(range(n)))
    reports.put({"rank": rank, "ready": True})
    while True:
        task = jobs.get()
        if task is None:
            break
        try:
            reports.put({"rank": rank, **_run_job(task, rank, n, m, replicas, mesh, groups)})
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which judges the run
            reports.put(
                {
                    "rank": rank,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()[-2000:],
                }
            )
    os._exit(0)  # every report was taken already; tearing down gloo and torch costs seconds per rank


def _run_job(task: dict, rank: int, n: int, m: int, replicas: int, mesh, groups: dict) -> dict:
    model = ModelShape(**task["model"])
    plan = plan_of(task, n, m)
    plane = task.get("plane", "auto")
    plane = choose_data_plane(replicas)[0] if plane == "auto" else plane
    if plane == BROADCAST and not groups:
        raise ValueError(
            "the broadcast plane needs a world of 2 replicas or more (its groups are made at start)"
        )
    steps = []
    engine_rank = (rank - n) % m if rank >= n else None  # the same rank on every replica
    shards = EngineShards(plan, engine_rank) if rank >= n else None
    layout = plan.trainer
    for step in range(task["steps"]):
        full = full_weights(model, task["dtype"], task["seed"] + step)
        t0 = time.perf_counter()
        if rank < n:
            local = trainer_shards(task["api"], model, layout, full, mesh)
            if plane == BROADCAST:
                moved = broadcast_shards(plan, rank, local, groups)
            else:
                hook = _killer(task, "trainer", rank, step)
                moved = send_shards(
                    plan, rank, local, batched=hook is None, before_send=hook, replicas=replicas
                )
            problems = []
        else:
            shards.poison()
            if plane == BROADCAST:
                moved = receive_broadcast_shards(plan, engine_rank, shards, groups)
            else:
                moved = receive_shards(
                    plan, engine_rank, shards, after_receive=_killer(task, "engine", rank - n, step)
                )
            expected = expected_engine_shards(full, plan.engine, engine_rank)
            problems = bitwise_mismatches(expected, shards.tensors)
            for live, to in plan.tied().items():
                if shards.tensors[live].data_ptr() != shards.tensors[to].data_ptr():
                    problems.append(f"{live}: not the storage of {to} it is tied to")
        steps.append({"bytes": moved, "seconds": time.perf_counter() - t0, "problems": problems})
    return {"steps": steps, "plane": plane}


def _killer(task: dict, role: str, rank: int, step: int):
    """The job's kill hook for this rank in this step (called with the count of messages so far), or None."""
    kill = task.get("kill")
    if not kill or step or tuple(kill[:2]) != (role, rank):
        return None

    def hook(count: int) -> None:
        if count == kill[2]:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


class ReshardWorld:
    """N trainer + R x M engine rank processes (R replicas of an M-rank engine) in one gloo world
    (timeout_s: the process group's timeout, which bounds any wait on a peer that is gone)."""

    def __init__(
        self,
        n_trainers: int,
        n_engines: int,
        timeout_s: float = 20.0,
        start_within_s: float = 120.0,
        replicas: int = 1,
    ):
        self.n, self.m, self.timeout_s, self.replicas = n_trainers, n_engines, timeout_s, replicas
        size = self.n + replicas * self.m
        self.broken = False
        # forks of harness.warm's server (torch imported once): a spawned rank imported torch itself, 2-3
        # CPU-seconds each, and the default tier starts about forty of them
        ctx = warm.context(("harness.reshard.world",))
        self._reports = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(size)]
        # the parent hosts the store on a port the kernel picks and holds it for the world's life (a port
        # picked free and then released can be taken by another run's world on a shared machine)
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=start_within_s),
        )
        port, prefix = self._store.port, f"reshard-{uuid.uuid4().hex}"
        parent, world = warm.here(), (self.n, self.m, replicas, port, prefix)
        self.procs = [
            ctx.Process(
                target=warm.inherit,
                args=(parent, _rank_main, r, *world, self._jobs[r], self._reports, timeout_s),
                daemon=True,
                name=f"reshard-rank-{r}",
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        ready = set()
        deadline = time.monotonic() + start_within_s
        while len(ready) < len(self.procs):
            if time.monotonic() > deadline or any(p.exitcode is not None for p in self.procs):
                self.close()
                raise RuntimeError(
                    f"reshard world {self.n}+{replicas}x{self.m}: ranks {sorted(set(range(len(self.procs))) - ready)} "
                    f"not up within {start_within_s:g}s; exits {[describe_exit(p.exitcode) for p in self.procs]}"
                )
            try:
                ready.add(self._reports.get(timeout=0.2)["rank"])
            except queue.Empty:
                pass

    def run(self, task: dict, within_s: float | None = None) -> WorldRun:
        """Send `task` to every rank and collect their reports; a rank that dies is named with its exit,
        and the others are waited for until `within_s` (default 2x the group timeout + 10 s)."""
        if self.broken:
            raise RuntimeError("this world lost a rank or a report in an earlier job; start a new one")
        within_s = within_s if within_s is not None else 2 * self.timeout_s + 10
        t0 = time.monotonic()
        for q in self._jobs:
            q.put(task)
        reports: dict[int, dict] = {}
        dead: dict[int, str] = {}
        while time.monotonic() - t0 < within_s:
            for r, p in enumerate(self.procs):
                if p.exitcode is not None and r not in reports and r not in dead:
                    dead[r] = describe_exit(p.exitcode)
            if len(reports) + len(dead) == len(self.procs):
                break
            try:
                rep = self._reports.get(timeout=0.1)
                reports[rep["rank"]] = rep
            except queue.Empty:
                pass
        silent = [r for r in range(len(self.procs)) if r not in reports and r not in dead]
        run = WorldRun(self.n, self.m, reports, dead, silent, time.monotonic() - t0, self.replicas)
        if dead or silent or any(rep.get("error") for rep in reports.values()):
            self.broken = True  # a gloo group that lost a peer or a message is not reused
        return run

    def close(self) -> None:
        for q in self._jobs:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (0 if self.broken else 5)  # a broken group may never tear down
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._store = None  # the parent's listening socket goes with the world

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
