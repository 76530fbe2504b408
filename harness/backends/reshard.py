"""Built-in backend `reshard`: the resharded sync (harness.reshard) from N FSDP trainer ranks into R
tensor-parallel engines of M ranks each (issue 39 item 1).

    trainer process (the test's)                      N trainer rank processes (warm forks)
    ReshardSender: full tensors -> /dev/shm  ------>  each maps it, keeps its Shard(0) rows, sends its
                                                      planned transfers over the world (gloo)
    per engine (receiver): a TPReferenceEngine        its M ranks (the leader here, M - 1 warm forks)
    ReshardReceiver: vLLM's lifecycle         <------ receive straight into fresh shards, stage; finish
                                                      commits on every rank or none (vote-then-swap)

One world of N + R x M ranks (trainers first, then each engine's ranks: `plan.world_rank`), its store
hosted here: gloo on the host; on one GPU the ipc plane, whose bytes move through buffers the store names
(gloo forms the world); with a GPU per rank, NCCL, each rank on its own GPU (`reshard.collective`). After
a failed sync `recover()` replaces what died or hung and every rank joins a new world.
The shape comes from the command line (`weightsync certify --backend reshard --trainer-ranks N --tp M`),
carried to every process of the run as the device is (`RESHARD_ENV`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import threading
import time
import traceback
import uuid
import warnings

from harness import deadline, host_load
from harness.api import (
    DEFAULT_ENGINE,
    DEFAULT_TIMEOUT_S,
    Backend,
    BackendError,
    Capabilities,
    Deployment,
    DeployRequest,
    EngineHandle,
    RankInfo,
    TensorSpec,
    TransferError,
    WeightSpec,
    WeightSyncError,
)
from harness.engines.tp_reference import TP_MODEL, TPReferenceEngine
from harness.launch.rank_deployment import RESTART_FACTOR, RESTART_FLOOR_S
from harness.launch.supervision import KILL_S, POLL_INTERVAL
from harness.reshard.collective import NCCL, gpu_count, placement
from harness.reshard.layout import DTYPES, ModelShape
from harness.reshard.path import ReshardReceiver, ReshardSender
from harness.reshard.sync import IPC, PLANE_ENV
from harness.reshard.trainer_ranks import JOIN, TrainerRanks

#: "N,M": trainer ranks and TP size of the run (set by `weightsync ... --trainer-ranks N --tp M` and by
#: pytest's --weightsync-trainer-ranks / --weightsync-tp), read by `make_backend`
RESHARD_ENV = "WEIGHTSYNC_RESHARD"
DEFAULT_TRAINER_RANKS, DEFAULT_TP = 3, 2
DTYPE = "float32"  # the TP engine's
#: How long forming a world may take (N + R x M processes connecting pairwise: seconds on a loaded 2-core
#: host, past a fault cell's 4 s timeout); each transfer in it is bounded by the deployment's timeout
JOIN_S = 30.0
#: On a GPU every rank of the world makes a CUDA context as it joins: a certify's parallel cells start a
#: world each, N + R x M contexts on one GPU at once; 60 s leaves them room
GPU_JOIN_S = 60.0
#: Past join_s, how long the deployment waits for a side's join to return (each side's own bound is join_s)
JOIN_GRACE_S = 15.0
#: The GPU variant's gate (every rank on one GPU, the ipc plane): a version is copied three times on the
#: device (into the trainer's staging buffer, into each trainer rank's shard, into each engine rank's
#: shard) and digested twice, where the device-copy ceiling copies it once; every sync is ~10 round trips
#: to processes (trainer ranks' pipes, the TP group's commands). Fitted on the H100 (two engines,
#: 2026-12-06): 0.40 and 0.74 of the verified ceiling, 18 and 31 ms fixed
GPU_BANDWIDTH_FLOOR, GPU_FIXED_COST_MS = 0.2, 80.0
#: engine replicas a deployment holds at most (Capabilities.max_receivers): a host with a GPU for each of
#: N + MAX_REPLICAS x M ranks runs the NCCL variant
MAX_REPLICAS = 2
GPU_FLOOR_REASON = (
    "three device copies of each version (trainer staging, each trainer rank's shard, each engine rank's "
    "shard) and two digests, where the device-copy ceiling copies once; fitted at 0.40 and 0.74 of it, "
    "18 and 31 ms fixed, on the H100 (two engines, 2026-12-06)"
)
#: The NCCL variant (a GPU per rank) keeps the CPU variant's floor of 0.2 of its ceiling until a run on
#: such a host fits one: no host with a GPU per rank has been lent to this project yet
NCCL_FLOOR_REASON = (
    "each transfer one NCCL send (or broadcast) from the trainer rank's GPU to its engine ranks' GPUs, "
    "besides one staging copy of each version and two digests on the device; floored at 0.2 of the "
    "verified NCCL ceiling, as the gloo variant is, until a host with a GPU per rank measures it"
)
#: engines it delivers into: its own TP engine whatever the run names (the engine is half of the path),
#: so the reference engine's name and the fault cells' wrapper are taken as "the engine under test"
SERVED_ENGINES = (None, DEFAULT_ENGINE, "harness.faults.engines:make_engine", "reference")
#: the tied-embedding engine's name (the suites' --weightsync-tied-engine): the same TP engine, its model tied
TIED_ENGINES = ("harness.engines.reference:make_tied_engine", "reference-tied")


def shape_from_env() -> tuple[int, int]:
    """(trainer ranks, TP size) this run names (RESHARD_ENV), else the defaults (3, 2)."""
    raw = os.environ.get(RESHARD_ENV)
    if not raw:
        return DEFAULT_TRAINER_RANKS, DEFAULT_TP
    try:
        n, m = (int(x) for x in raw.split(","))
    except ValueError:
        raise BackendError(f"{RESHARD_ENV}={raw!r}: expected 'N,M' (trainer ranks, TP size)") from None
    return n, m


def set_run_shape(trainer_ranks: int | None, tp: int | None) -> None:
    """Name the run's shape for this process and every process it starts (the pytest runs of a certify)."""
    if trainer_ranks is None and tp is None:
        return
    n, m = shape_from_env()
    os.environ[RESHARD_ENV] = f"{trainer_ranks or n},{tp or m}"


@dataclasses.dataclass(frozen=True)
class RankProcessRef:
    rank: str
    pid: int


class ReshardDeployment(Deployment):
    """N trainer rank processes and `replicas` TP engines of `tp` ranks, one gloo world."""

    def __init__(
        self,
        n_trainers: int,
        tp: int,
        replicas: int,
        timeout_s: float,
        model: ModelShape = TP_MODEL,
        device: str = "cpu",
    ):
        self.timeout_s, self.model, self.device = timeout_s, model, device
        self.join_s = JOIN_S if device == "cpu" else GPU_JOIN_S
        self.n_trainers, self.tp, self.replicas = n_trainers, tp, replicas
        #: gloo, or NCCL with a GPU per rank; where each world rank keeps its shards
        self.collective, self.devices = placement(self.world_size, device, gpu_count(device))
        self.restarts = 0
        self.handles: list[EngineHandle] = []
        #: each engine's receiver (a fault may wrap the one its handle holds for a push)
        self.receivers: list[ReshardReceiver] = []
        self.trainer_ranks: TrainerRanks | None = None
        self._store = None
        t0 = time.monotonic()
        try:
            self.trainer_ranks = TrainerRanks(n_trainers)
            for i in range(replicas):
                engine = self._engine(i)
                self.receivers.append(ReshardReceiver(engine, f"engine {i}"))
                self.handles.append(EngineHandle(self.receivers[-1], engine))
            self.sender = ReshardSender(
                self.trainer_ranks, model, DTYPE, tp, replicas, timeout_s, self.devices[0], self.collective
            )
            self.own_engine = ReshardBackend.own_engine
            self.connect()
        except BaseException:
            self.close()
            raise
        #: how long the deployment took to form, measured: every rank started, the world joined (a
        #: recovery redoes part of it, and gets RESTART_FACTOR x this of its own)
        self.formed_s = time.monotonic() - t0

    def _engine(self, i: int) -> TPReferenceEngine:
        """Engine `i`: its ranks on their devices (with NCCL, each its own GPU)."""
        base = self.n_trainers + i * self.tp
        return TPReferenceEngine(
            self.model,
            tp=self.tp,
            dtype=DTYPE,
            timeout_s=self.timeout_s,
            device=self.devices[base : base + self.tp],
        )

    @property
    def world_size(self) -> int:
        return self.n_trainers + self.replicas * self.tp

    def connect(self, retry: bool = True) -> None:
        """A new world: every trainer rank and every engine rank join it at once (a collective), within
        join_s + JOIN_GRACE_S; a side that has not returned by then is named with where it stood (once,
        `retry`: a stuck engine is replaced and everyone joins a fresh world)."""
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.join_s),
        )
        self.sender.store_port = self._store.port  # where the world forms (the port-taken cell's target)
        world = {
            "port": self._store.port,
            "prefix": f"reshard-{uuid.uuid4().hex}",
            "size": self.world_size,
            "timeout_s": self.timeout_s,
            "join_s": self.join_s,
            # the data plane and, on the broadcast plane, what each rank needs to form its groups
            "plane": self.sender.plane,
            "device": self.device,  # where every rank's shards live (the ipc plane's buffers)
            "collective": self.collective,  # gloo, or NCCL with a GPU per rank ...
            "devices": self.devices,  # ... each world rank's
            "trainers": self.n_trainers,
            "engines": self.tp,
            "replicas": self.replicas,
        }
        stuck, stuck_engines, errors = self._join_all(world)
        if stuck and retry:
            # an engine whose leader never reached the world (seen on the H100: 2 of ~70 worlds) is
            # replaced, said aloud with where it stood, and every rank joins a fresh world once more
            warnings.warn(
                f"reshard world formation: {'; '.join(stuck)}; replacing and joining again",
                RuntimeWarning,
                stacklevel=2,
            )
            for i in stuck_engines:
                self._abandon_engine(i)
            self._replace_failed_engines()  # the others' joins timed out waiting for it: failed too
            self.trainer_ranks.restart_unhealthy()
            return self.connect(retry=False)
        if stuck:
            raise TransferError(
                f"the resharding world did not form in {self.join_s + JOIN_GRACE_S:g}s: {'; '.join(stuck)}"
            )
        if errors:
            raise errors[0]

    def _join_all(self, world: dict) -> tuple[list[str], list[int], list[BaseException]]:
        """Every trainer rank and every engine's ranks join `world`, each side from a thread of its own,
        bounded: (what had not returned by join_s + JOIN_GRACE_S, with its stack; the engines among them;
        the errors raised)."""
        outcome: dict[str, BaseException | None] = {}

        def run(key: str, fn, *args) -> None:
            try:
                fn(*args)
                outcome[key] = None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome[key] = exc

        jobs = [("trainer ranks", self.trainer_ranks.call, JOIN, [world] * self.n_trainers, self.join_s + 5)]
        jobs += [
            (
                f"engine {i}",
                h.receiver.init_transfer_engine,
                {"world": {**world, "base": self.n_trainers + i * self.tp}},
            )
            for i, h in enumerate(self.handles)
        ]
        threads = [
            threading.Thread(target=run, args=job, daemon=True, name=f"reshard-join {job[0]}") for job in jobs
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.join_s + JOIN_GRACE_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        frames = sys._current_frames()
        stuck, stuck_engines = [], []
        for (key, *_), t in zip(jobs, threads, strict=True):
            if t.is_alive():
                where = (
                    "".join(traceback.format_stack(frames.get(t.ident))[-4:]) if t.ident in frames else "?"
                )
                stuck.append(f"{key} had not returned, at:\n{where}")
                if key.startswith("engine "):
                    stuck_engines.append(int(key.split()[1]))
        return stuck, stuck_engines, [e for e in outcome.values() if e is not None]

    def _abandon_engine(self, i: int) -> None:
        """Engine `i` is stuck in a join (its leader's thread holds its lock): its worker ranks are killed,
        the object left to its thread, a fresh engine in its place."""
        h = self.handles[i]
        h.engine.workers.close(within_s=0)
        h.engine = self._engine(i)
        self.receivers[i].rebind(h.engine)
        self.restarts += 1

    @property
    def ranks(self) -> list[RankProcessRef]:
        """Every rank process of the deployment (trainer ranks, then each engine's worker ranks), as the
        resource checks count processes (`rank`, `pid`)."""
        out = [RankProcessRef(f"trainer {i}", p.pid) for i, p in enumerate(self.trainer_ranks.processes())]
        for i, h in enumerate(self.handles):
            out += [
                RankProcessRef(f"engine {i} tp {r}", pid) for r, pid in enumerate(h.engine.rank_pids(), 1)
            ]
        return out

    def processes(self) -> list[RankInfo]:
        """Per engine, in the order of `handles`, its TP rank 1 (a worker process; rank 0 leads in the
        trainer's process): what a receiver fault strikes. Named as the receivers' errors name their engine."""
        if self.tp < 2:
            return []
        return [RankInfo(f"engine {i}", h.engine.rank_pids()[0]) for i, h in enumerate(self.handles)]

    def trainer_processes(self) -> list[RankInfo]:
        return self.trainer_ranks.processes()

    def healthy(self) -> bool:
        engines = all(self._engine_ok(h.engine) for h in self.handles)
        return engines and self.trainer_ranks.answering(self.timeout_s)

    @staticmethod
    def _engine_ok(engine: TPReferenceEngine) -> bool:
        return engine.failure is None and not engine.workers.dead()

    def _replace_failed_engines(self) -> list[int]:
        """Replace every engine whose rank died or hung (or that failed) by a fresh one; their indices."""
        replaced = []
        for i, (h, receiver) in enumerate(zip(self.handles, self.receivers, strict=True)):
            if not self._engine_ok(h.engine):
                h.engine.shutdown()
                h.engine = self._engine(i)
                receiver.rebind(h.engine)
                self.restarts += 1
                replaced.append(i)
        return replaced

    def recovery_budget_s(self) -> float:
        """How long a recovery may take: RESTART_FACTOR x what forming the deployment took (measured at
        deploy, every rank started side by side), at least RESTART_FLOOR_S."""
        return max(RESTART_FACTOR * self.formed_s, RESTART_FLOOR_S)

    def recover(self) -> None:
        """Replace engines and trainer ranks that died or hung, then a new world for everyone. Inside a
        watched phase (a push that recovers from a rank that died at its start) the phase's clock stops
        meanwhile and the recovery has a budget of its own, from this deployment's measured formation:
        on a GPU every replaced rank makes a CUDA context and the world forms again, which a phase's
        slack was never meant to pay (the H100, 2026-12-06: a receiver killed in start overran 18 s)."""
        budget = self.recovery_budget_s()
        what = f"re-forming the resharding world (it formed in {self.formed_s:.2f} s at deploy)"
        # the join's own bound (join_s + JOIN_GRACE_S) names a stuck side first where it is the shorter;
        # the watch is the backstop, extended by what the host kept the recovery waiting for a CPU
        backstop = budget * (1 + host_load.MAX_EXTENSION) + KILL_S + POLL_INTERVAL
        with deadline.paused(what, backstop):
            steps, t0 = [], time.monotonic()
            replaced = self._replace_failed_engines()
            steps.append(f"engines replaced {replaced} in {time.monotonic() - t0:.2f} s")
            t0 = time.monotonic()
            restarted = self.trainer_ranks.restart_unhealthy()
            self.restarts += len(restarted)
            steps.append(f"trainer ranks restarted {restarted} in {time.monotonic() - t0:.2f} s")
            t0 = time.monotonic()
            for r in self.receivers:
                with contextlib.suppress(WeightSyncError):  # an engine that cannot abort is replaced
                    r.abort_weight_update()
            self.sender.reset_base()
            steps.append(f"aborted in {time.monotonic() - t0:.2f} s")
            t0 = time.monotonic()
            self.connect()
            steps.append(f"world formed in {time.monotonic() - t0:.2f} s")
            # where a recovery's time went, beside a failing test's output (captured stderr)
            print(
                f"reshard recovery ({budget:.1f} s budget): {'; '.join(steps)}", file=sys.stderr, flush=True
            )

    def reset(self, spec: WeightSpec | None = None) -> None:
        check_spec(spec, self.model)
        replaced = self._replace_failed_engines()
        for i, h in enumerate(self.handles):
            if i not in replaced:  # a fresh engine's state without new processes: the world stays joined
                h.engine.reset_weights()
        for r in self.receivers:
            r.lifecycle.to("ready")
        if replaced or not self.trainer_ranks.healthy():
            self.trainer_ranks.restart_unhealthy()
            self.connect()
        self.sender.reset()

    def close(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):  # the others are closed whatever one does
                h.engine.shutdown()
        if self.trainer_ranks is not None:
            self.trainer_ranks.close()
        sender = getattr(self, "sender", None)
        if sender is not None:
            sender.shutdown()
        self._store = None


def check_spec(spec: WeightSpec | None, shape: ModelShape = TP_MODEL) -> None:
    """The reshard backend serves the TP engine's model: a spec naming anything else is refused."""
    model = {n: TensorSpec(s, DTYPES[DTYPE]) for n, s in shape.checkpoint_shapes().items()}
    extra = sorted(n for n, s in (spec or {}).items() if model.get(n) != s)
    if extra:
        raise BackendError(f"the reshard backend serves the TP engine's model only; not {extra[:5]}")


class ReshardBackend(Backend):
    """Built-in backend `reshard`: N trainer ranks -> R engines of TP M over one world (gloo; NCCL with a
    GPU per rank)."""

    name = "reshard"
    ceiling = "gloo"  # on the host every transfer is a gloo send from a trainer rank to an engine rank
    measure = "harness.reshard_throughput:measure_sync"  # a fixed model: rows are models of each size
    bandwidth_floor = 0.2
    floor_reason = (
        "besides the plan's gloo sends, every version is copied once into /dev/shm for the trainer ranks and "
        "each engine shard is digested twice (the oracle's cut in the trainer, the received shard on its rank): "
        "0.56 of the verified gloo ceiling fitted on the 2-core VM at load average 9-13 (3 -> 2 x TP 2, "
        "2026-12-06; 0.35 before the /dev/shm file was reused), floored at 0.2 for a loaded one"
    )
    own_engine = (
        "it delivers into its own TP reference engine (harness.engines.tp_reference), whose ranks receive "
        "the planned shards; the reference engine's name stands for it. Data plane: point to point for one "
        "engine, broadcast per engine rank group for two or more (each transfer one broadcast from its "
        "trainer rank to the copies of its engine rank, where point to point would send it once per "
        "engine); on one GPU, every rank on it, ipc (each engine rank copies its slices out of the trainer "
        "ranks' shards through CUDA IPC handles; on the host, /dev/shm); with a GPU per rank, point to point "
        f"or broadcast over NCCL, device to device; {PLANE_ENV} names one"
    )

    def __init__(
        self,
        trainer_ranks: int = DEFAULT_TRAINER_RANKS,
        tp: int = DEFAULT_TP,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: str = "cpu",
    ):
        self.device = device
        #: the NCCL variant where every rank of the largest deployment has a GPU of its own
        self.collective, _ = placement(trainer_ranks + MAX_REPLICAS * tp, device, gpu_count(device))
        if device != "cpu":
            # N + 2M CUDA contexts per fault cell's deployment: 8 workers x 2 suites at once on the H100
            # (run1, 2026-12-06) started up to 16 worlds, 112 processes, on one GPU at once
            self.max_jobs = 4
        if self.collective == NCCL:  # p2p / broadcast device to device, each rank on its GPU
            self.ceiling = "nccl"
            self.floor_reason = NCCL_FLOOR_REASON
        elif device != "cpu":  # every rank on this GPU: the ipc plane (sync.choose_data_plane)
            self.ceiling = "device-copy"
            self.bandwidth_floor = GPU_BANDWIDTH_FLOOR
            self.fixed_cost_ms = GPU_FIXED_COST_MS
            self.floor_reason = GPU_FLOOR_REASON
        elif os.environ.get(PLANE_ENV) == IPC:  # named: engine ranks copy out of /dev/shm
            self.ceiling = "memcpy"
        if trainer_ranks < 1 or tp < 1:
            raise BackendError(f"reshard: trainer ranks {trainer_ranks} and tp {tp} must be >= 1")
        try:
            TP_MODEL.check_tp(tp)
        except ValueError as exc:
            raise BackendError(f"reshard --tp {tp}: {exc}") from None
        self.trainer_ranks, self.tp, self.timeout_s = trainer_ranks, tp, timeout_s
        self.model = TP_MODEL
        self.capabilities = Capabilities(
            gpu=device != "cpu",
            dtypes=frozenset({DTYPES[DTYPE]}),
            multi_receiver=True,
            max_receivers=MAX_REPLICAS,  # N + 2 x M processes: what a 2-core, 8 GiB tier holds beside the other paths
            arbitrary_tensors=False,  # the TP engine serves one model
            trainer_ranks=True,  # N trainer rank processes: the trainer-rank fault cells strike them
        )

    def with_model(self, model: ModelShape) -> ReshardBackend:
        """This backend with its deployments serving `model` (the throughput rows' models of each size)."""
        try:
            model.check_tp(self.tp)
        except ValueError as exc:
            raise BackendError(f"reshard --tp {self.tp}: {exc}") from None
        other = copy.copy(self)
        other.model = model
        return other

    def build(self, request: DeployRequest) -> Deployment:
        if request.engine not in SERVED_ENGINES + TIED_ENGINES:
            raise BackendError(
                f"the reshard backend delivers into its own TP reference engine, not {request.engine!r}"
            )
        model = dataclasses.replace(self.model, tied=request.engine in TIED_ENGINES)
        check_spec(request.spec, model)
        return ReshardDeployment(
            self.trainer_ranks, self.tp, request.n_receivers, self.timeout_s, model, self.device
        )


def make_backend(device: str = "cpu") -> ReshardBackend:
    """The run's shape (RESHARD_ENV: `--trainer-ranks N --tp M`), else 3 trainer ranks into TP 2; on a GPU
    `device`, every trainer and engine rank on it (the ipc plane: CUDA IPC handles), or where the host has a
    GPU for each rank, each on its own (NCCL)."""
    n, m = shape_from_env()
    return ReshardBackend(n, m, device=device)
