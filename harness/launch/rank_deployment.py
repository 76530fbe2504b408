"""A sender in this process and N receiver ranks in supervised processes as one `Deployment`: ranks
started side by side, connected (every rank's init beside the sender's, a process group being itself a
collective), restarted when they die or hang, each restart with a budget measured at deploy."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from pathlib import Path

from harness import deadline, host_load, warm
from harness.api import (
    DEFAULT_TIMEOUT_S,
    JSON,
    Deployment,
    EngineHandle,
    RankFailure,
    RankInfo,
    Sender,
    WeightSpec,
    WeightSyncError,
)
from harness.launch.pipe_proxies import PipeEngine, PipeReceiver
from harness.launch.supervision import KILL_S, POLL_INTERVAL, RPC_SLACK, START_TIMEOUT, RankProcess
from harness.ranks import protocol

#: A rank restarted inside a watched phase gets this multiple of the slowest start measured at deploy,
#: which started every rank side by side (a lone restart competes with fewer): room for a host whose
#: load grew since the deploy, still a bound that catches a restart that hangs. Never less than
#: RESTART_FLOOR_S: a warm start is too short to scale (measured on 2 cores: 0.03 s quiet, 0.1-0.25 s
#: beside 4 busy loops), and under a second the host's scheduler decides more than the restart does.
RESTART_FACTOR = 4.0
RESTART_FLOOR_S = 1.0


class RankDeployment(Deployment):
    """A Sender in this process (rank 0) and N receiver ranks in spawned processes, supervised.

    `connect()` runs `rank_init_info(init_info, rank)` for every rank concurrently with the sender's
    own join, because forming a process group is itself a collective. `recover()` restarts the ranks
    that died or were killed for not answering, then connects everyone again (a new group)."""

    def __init__(
        self,
        sender: Sender,
        receiver_path: str,
        n_receivers: int,
        spec: WeightSpec | None,
        engine: str | None,
        workdir: str,
        rank_init_info: Callable[[JSON, int], JSON],
        timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self.sender = sender
        self.timeout_s = timeout
        self.restarts = 0
        self._receiver_path, self._engine, self._rank_init_info = receiver_path, engine, rank_init_info
        self._spec = spec
        self._log_dir = Path(workdir) / "ranks"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.ranks: list[RankProcess] = []
        self.handles = []
        #: seconds each rank took to start at deploy (warm server booted before): a restart's budget
        self.start_s: dict[int, float] = {}
        try:
            self._prepare_spawn()
            # ranks start side by side: each builds its engine
            with cf.ThreadPoolExecutor(max_workers=max(n_receivers, 1), thread_name_prefix="spawn") as pool:
                futures = [pool.submit(self._timed_spawn, i + 1) for i in range(n_receivers)]
            for f in futures:  # keep what started, so close() stops it, then raise the first failure
                if f.exception() is None:
                    self.ranks.append(f.result())
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
            self.handles = [self._handle_for(r) for r in self.ranks]
            self.connect()
        except BaseException:
            self.close()
            raise

    def _prepare_spawn(self) -> None:
        """Before the first rank starts: boot the warm fork server (once per process), so the ranks'
        measured starts are their own."""
        warm.context(warm.engine_preload(self._engine))

    def _spawn_rank(self, rank: int, start_timeout: float = START_TIMEOUT) -> RankProcess:
        """Start receiver rank `rank` (first start and restarts); a subclass may place it elsewhere."""
        return RankProcess(
            rank,
            self._receiver_path,
            self._engine,
            self._spec,
            self._log_dir,
            self.timeout_s * RPC_SLACK,
            start_timeout,
        )

    def _timed_spawn(self, rank: int) -> RankProcess:
        t0 = time.monotonic()
        r = self._spawn_rank(rank)
        self.start_s[rank] = time.monotonic() - t0
        return r

    def restart_budget_s(self) -> float:
        """How long restarting one rank may take: RESTART_FACTOR x the slowest start measured at deploy
        (at least RESTART_FLOOR_S; START_TIMEOUT where nothing was measured)."""
        if not self.start_s:
            return START_TIMEOUT
        return max(RESTART_FACTOR * max(self.start_s.values()), RESTART_FLOOR_S)

    def _restart_rank(self, rank: int) -> RankProcess:
        """Start rank `rank` again. Inside a watched phase the phase's clock stops meanwhile and the
        restart has a budget of its own, from this deployment's measured starts (not the phase's)."""
        self._prepare_spawn()  # a warm server that died boots again here, not inside the restart's budget
        budget = self.restart_budget_s()
        slowest = max(self.start_s.values(), default=0.0)
        what = f"restarting rank {rank} (its ranks started in {slowest:.2f} s at deploy)"
        # a pause, not a longer phase: the phase keeps its budget for its own work whatever the restart
        # took, and a restart is judged by what starting a rank measured here, not by the phase's slack;
        # the supervisor's own kill fires first, with its specific error; the watch is the backstop
        # the start's own deadline moves by what the host kept it waiting for a CPU (RankProcess): so may this
        backstop = budget * (1 + host_load.MAX_EXTENSION) + KILL_S + POLL_INTERVAL
        with deadline.paused(what, backstop) as watched:
            try:
                return self._spawn_rank(rank, budget if watched else START_TIMEOUT)
            except RankFailure as exc:
                raise RankFailure(f"{what}: {exc}") from None

    def _handle_for(self, rank: RankProcess) -> EngineHandle:
        """How the trainer talks to a rank's receiver and engine (here: over its pipe)."""
        return EngineHandle(PipeReceiver(rank), PipeEngine(rank))

    def connect(self) -> None:
        """sender.init() and every rank's init_transfer_engine, concurrently; the first error is raised."""
        init_info = self.sender.init()
        errors: list[BaseException] = []

        def init_one(h: EngineHandle, rank: int) -> None:
            try:
                h.receiver.init_transfer_engine(self._rank_init_info(init_info, rank))
            except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)

        threads = [
            threading.Thread(target=init_one, args=(h, r.rank)) for h, r in zip(self.handles, self.ranks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def processes(self) -> list[RankInfo]:
        return [RankInfo(f"rank {r.rank}", r.pid, str(r.log_path)) for r in self.ranks]

    def healthy(self) -> bool:
        return all(r.healthy for r in self.ranks)

    def take_phases(self) -> list[dict[str, dict[str, float]]]:
        """Each rank's phase times since the last take (recorded when harness.phases was on at spawn)."""
        return [protocol.call(r, "take_phases") for r in self.ranks]

    def _restart_unhealthy(self) -> bool:
        """Replace every rank that died or was killed; True if any was."""
        restarted = False
        for i, r in enumerate(self.ranks):
            if not r.healthy:
                r.stop(timeout=2.0)
                fresh = self._restart_rank(r.rank)
                self.ranks[i] = fresh
                handle = self._handle_for(fresh)
                self.handles[i].receiver, self.handles[i].engine = handle.receiver, handle.engine
                self.restarts += 1
                restarted = True
        return restarted

    def recover(self) -> None:
        self._restart_unhealthy()
        for h in self.handles:  # an update left open on a rank that was unreachable when push aborted
            try:
                h.receiver.abort_weight_update()
            except WeightSyncError:
                pass
        self.sender.reset_base()  # a restarted engine holds version 0: delta must send whole tensors
        self.connect()

    def reset(self, spec: WeightSpec | None = None) -> None:
        self._spec = spec  # a rank restarted later gets the spec its siblings have
        if self._restart_unhealthy():
            self.connect()
        self.sender.reset()
        for r in self.ranks:
            protocol.call(r, "reset", spec=spec)

    def close(self) -> None:
        if self.ranks:
            with cf.ThreadPoolExecutor(max_workers=len(self.ranks), thread_name_prefix="stop") as pool:
                list(pool.map(lambda r: r.stop(), self.ranks))
        self.sender.shutdown()
