"""The tensor-parallel reference engine: the reshard model (`reshard.layout.ModelShape`) served by M rank
processes, each holding only its engine shard of every parameter (vLLM's split: `reshard.oracle`), whose
forward needs all M (an all-reduce after the row-parallel layers, an all-gather of the vocab-parallel
logits; `tp_model`). So "in-flight requests survive pause/resume" and "no output mixes two versions"
mean here what they mean for a TP engine.

The leader (rank 0) is this object, in the caller's process: it schedules (continuous batching, the three
pause modes, versions) and sends each step's batch to the worker ranks (`tp_group`); every rank keeps the
KV cache of its own kv heads. A commit stages each rank's shards, then swaps them in on every rank at one
step boundary once all ranks voted they hold the whole version (`tp_rank.TPRank.commit`): committed on
all ranks or none. Every step gathers each rank's live version: a token is stamped with the version all
M ranks computed it with, and a step whose ranks disagree fails the engine rather than emit it.

A rank that dies or hangs fails the engine within the group timeout: in-flight requests end as aborted,
and every later call raises EngineStateError naming each rank's state. No prefix cache (yet)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence

import torch

from harness.api import (
    EngineStateError,
    ManifestMismatch,
    PartialCommitError,
    TensorSpec,
    TransferError,
    VersionError,
    WeightSpec,
)
from harness.engines import tiny_lm, tp_model
from harness.engines.batching import BatchingEngine, Running
from harness.engines.tp_group import WorkerProcesses, join, send_command
from harness.engines.tp_rank import (
    COMMIT,
    DISCARD,
    JOIN_WORLD,
    READ,
    RECEIVE,
    RESET,
    STAGE,
    STEP,
    STOP,
    cut_shards,
    rank_device_of,
    rank_main,
    shard_shapes,
)
from harness.registry import load_object
from harness.reshard.gather import gather_full
from harness.reshard.layout import DTYPES, ModelShape, engine_layout

#: The served model: GQA with kv heads replicated at TP 4, a vocabulary the padding does not fill
#: (100 of 128 rows), head_dim = hidden / heads so tiny_lm computes the same model in one process
TP_MODEL = ModelShape(
    vocab=100, hidden=16, heads=4, kv_heads=2, head_dim=4, intermediate=24, layers=2, tied=False
)
RANK_IMPL = "harness.engines.tp_rank:TPRank"


@dataclasses.dataclass
class _Running(Running):
    prefilled: bool = False  # every rank holds this request's KV cache


class TPReferenceEngine(BatchingEngine):
    running_class = _Running
    answered_step_errors = (EngineStateError,)  # _command failed the engine and says why

    def __init__(
        self,
        shape: ModelShape = TP_MODEL,
        tp: int = 2,
        dtype: str = "float32",
        seed: int = 0,
        max_batch: int = 8,
        timeout_s: float = 30.0,
        start_within_s: float = 120.0,
        idle_s: float = 3600.0,
        rank_impl: str = RANK_IMPL,
        device: str | Sequence[str] = "cpu",
    ):
        self.shape, self.tp, self.dtype, self.max_batch, self.timeout_s = (
            shape,
            tp,
            dtype,
            max_batch,
            timeout_s,
        )
        self.layout = engine_layout(shape, tp)
        self._spec = {n: TensorSpec(s, DTYPES[dtype]) for n, s in shape.checkpoint_shapes().items()}
        self._shard_shapes = shard_shapes(self.layout, dtype)
        self.workers = WorkerProcesses(
            tp,
            rank_main,
            (dataclasses.asdict(shape), dtype, seed, rank_impl, idle_s, device),
            timeout_s,
            start_within_s,
            prefix=f"tp-{uuid.uuid4().hex}",
        )
        try:
            self._pg = join(self.workers.info, self.workers.store)
            self.rank = load_object(rank_impl)(
                0, tp, shape, dtype, seed, self._pg, device=rank_device_of(device, 0)
            )
            self.workers.wait_built(start_within_s)  # no command before every rank is in its loop
        except BaseException:
            self.workers.close(0)
            raise
        self._version = 0
        self._failed: str | None = None
        self._drop: list[int] = []  # finished requests whose KV caches the ranks free at the next step
        self._start_batching(max_batch, "tp-reference-leader")  # every step, commit and read: one at a time

    # ------------------------------------------------------------------ the group
    def _command(self, op: str, payload, outgoing=None):
        """Send `op` to every rank and run the leader's part (the lock held); a failure fails the engine."""
        self._refuse_if_failed()
        try:
            send_command(self._pg, op, payload)
            return self.rank.serve(op, payload, outgoing)
        except Exception as exc:  # the group is out of step now: nothing can go on
            self._fail(f"{op} failed on the leader: {type(exc).__name__}: {str(exc)[:300]}")
            raise EngineStateError(self._failed) from exc

    def _fail(self, why: str) -> None:
        """Fail the engine (the lock held): in-flight requests end aborted, later calls are refused."""
        # a killed rank's sockets close before it is reaped: give its exit 2 s to show in the message
        self._failed = f"TP engine ({self.tp} ranks) failed: {why}; {self.workers.describe(settle_s=2.0)}"
        self._abort_all()
        self._cond.notify_all()

    def _refuse_if_failed(self) -> None:
        if self._failed is not None:
            raise EngineStateError(self._failed)

    @property
    def failure(self) -> str | None:
        """Why the engine failed (a rank died or hung, a step's ranks disagreed), or None."""
        return self._failed

    def rank_pids(self) -> list[int]:
        """The worker ranks' pids (rank 1 first), for the caller's leak checks and fault tests."""
        return [p.pid for p in self.workers.procs]

    # ------------------------------------------------------------------ Engine: state
    @property
    def weight_version(self) -> int:
        """The committed version; a failed engine cannot say what its ranks serve (EngineStateError)."""
        self._refuse_if_failed()
        return self._version

    def weight_spec(self) -> dict[str, TensorSpec]:
        return dict(self._spec)

    def model_config(self) -> dict | None:
        try:
            return tiny_lm.hf_config(tp_model.tiny_lm_config(self.shape, self.dtype))
        except ValueError:  # a shape tiny_lm (and so this config) does not describe
            return None

    def read_shards(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's live shards, rank 0 first ({live name: shard}; tied names left out)."""
        with self._priority():
            return self._command(READ, {"shapes": self._shard_shapes})

    def read_weights(self) -> dict[str, torch.Tensor]:
        """The committed version gathered from every rank's shards (`reshard.gather`): copies of a
        replicated tensor that differ between ranks are refused, naming the rank."""
        return gather_full(self.layout, self.read_shards())

    # ------------------------------------------------------------------ Engine: requests (BatchingEngine)
    def _vocab_size(self) -> int:
        return self.shape.vocab

    def _refuse(self, what: str) -> None:
        self._refuse_if_failed()

    def _stalled(self) -> bool:
        return self._failed is not None

    def _broken(self) -> bool:
        # bounded: each step is bounded by the group timeout, and a failure ends every request
        return self._failed is not None

    def _ended(self, r: Running) -> None:
        self._drop.append(r.seq)

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: the engine keeps no prefix cache."""

    # ------------------------------------------------------------------ Engine: commit
    def check_update(self, names, version: int) -> None:
        """The base checks, plus: the sources of a fused parameter (q, k, v; gate, up) come together."""
        names = set(names)
        super().check_update(names, version)
        for p in self.layout.params:
            sent = [s for s in p.sources if s in names]
            if sent and len(sent) < len(p.sources):
                missing = [s for s in p.sources if s not in names]
                raise ManifestMismatch(
                    f"version {version}: {sent[0]!r} is part of {p.name!r}; {missing} must be sent with it"
                )

    def commit_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Cut each rank's shards of `tensors` (the oracle's cut), stage them on every rank, then commit
        on all of them at once (`commit_staged`)."""
        self.check_update(tensors.keys(), version)
        self._check_tensors(tensors, version)
        full = {n: t.detach().cpu() for n, t in tensors.items()}
        per_rank = [cut_shards(self.layout, full, r) for r in range(self.tp)]
        with self._priority():
            if version <= self._version:  # re-checked: another commit may have landed meanwhile
                raise VersionError(f"version {version} is not newer than the committed {self._version}")
            names = list(per_rank[0])
            shapes = [{n: list(s[n].shape) for n in names} for s in per_rank]
            self._command(STAGE, {"version": version, "names": names, "shapes": shapes}, per_rank)
            self.commit_staged(version, names)

    def commit_staged(self, version: int, names: list[str]) -> None:
        """Commit `version` on every rank: each votes whether it staged all of `names` (live names) for it
        (`TPRank.stage`, whoever delivered them); all yes: every rank swaps at this step boundary; any no:
        every rank drops what it staged, and PartialCommitError names who lacked what."""
        with self._priority():
            votes = self._command(COMMIT, {"version": version, "names": names})
            if not all(v[0] for v in votes):
                lacking = [
                    f"rank {r}: staged version {v[1]} with {v[2]} of {len(names)} shards, live version {v[3]}"
                    for r, v in enumerate(votes)
                    if not v[0]
                ]
                raise PartialCommitError(
                    f"version {version} committed on no rank: {'; '.join(lacking)}", [v[3] for v in votes]
                )
            self._version = version
            self._cond.notify_all()

    # ------------------------------------------------------------------ the resharded sync's engine side
    def join_world(self, world: dict) -> None:
        """Every rank joins the resharded sync's world (`TPRank.join_world`): a collective with the trainer
        ranks, which join at the same time."""
        with self._priority():
            self._command(JOIN_WORLD, world)

    def receive_staged(
        self,
        version: int,
        names: list[str],
        trainers: int,
        planner: str,
        digests: list[dict],
        sync: str | None = None,
    ) -> list[int]:
        """Every rank receives its planned transfers of `version` (checkpoint `names`) from the `trainers`
        trainer ranks over the world and stages them (`TPRank.receive`); the bytes each rank received.
        A rank whose receive failed (a trainer rank gone, a transfer refused) stages nothing on any rank,
        and TransferError names every such rank and why (ManifestMismatch where each such rank received its
        bytes and found them unlike the manifest's `digests`); the engine keeps serving its committed version."""
        with self._priority():
            payload = {
                "version": version,
                "names": names,
                "trainers": trainers,
                "planner": planner,
                "digests": digests,
                "sync": sync,  # the update's name in the world's store (the ipc plane's)
            }
            outcomes = self._command(RECEIVE, payload)
        failed = [f"TP rank {r}: {text}" for r, (ok, _, text) in enumerate(outcomes) if not ok]
        if failed:
            refused = all(text.startswith("ManifestMismatch") for ok, _, text in outcomes if not ok)
            error = ManifestMismatch if refused else TransferError
            raise error(f"version {version} not received: {'; '.join(failed)}")
        return [moved for _, moved, _ in outcomes]

    def discard_staged(self) -> None:
        """Every rank drops what it staged."""
        with self._priority():
            self._command(DISCARD, None)

    def reset_weights(self) -> None:
        """A fresh engine's state without new processes: requests ended (aborted), not paused, version 0's
        seeded weights on every rank, nothing staged, no KV cache (the world joined stays joined)."""
        with self._priority():
            self._refuse_if_failed()
            self._abort_all()
            self._drop.clear()
            self._paused, self._drain_below = False, None
            self._command(RESET, None)
            self._version = 0
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._priority():
            if not self._stopped and self._failed is None:
                try:
                    send_command(self._pg, STOP, None)
                except RuntimeError as exc:  # gloo's: a rank went meanwhile; close() kills the rest
                    self._failed = f"TP engine ({self.tp} ranks): STOP not delivered: {str(exc)[:200]}"
            self._stopped = True
            self._abort_all()
            self._cond.notify_all()
        self._thread.join(timeout=10)
        # a failed group's ranks may never read STOP (one hung, or waiting on a peer that is gone)
        self.workers.close(within_s=0 if self._failed else 10)

    # ------------------------------------------------------------------ scheduler
    def _step(self) -> None:
        """One continuous-batching step on every rank: admit, then one token for each running request."""
        batch = self._admit()
        entries = [[r.seq, r.tokens if not r.prefilled else r.tokens[-1:], not r.prefilled] for r in batch]
        drop, self._drop = self._drop, []
        logits, versions = self._command(STEP, {"batch": entries, "drop": drop})
        if any(v != self._version for v in versions):
            self._fail(
                f"a step's ranks computed with versions {versions}, the leader committed {self._version}"
            )
            return
        for r, lg in zip(batch, logits, strict=True):
            r.prefilled = True
            self._emit(r, lg)


def make_engine(spec: WeightSpec | None = None, tp: int = 2) -> TPReferenceEngine:
    """Engine factory: TP_MODEL over `tp` ranks; a `spec` naming anything but the model's tensors is refused
    (the TP engine serves one model, it holds no extra buffers)."""
    engine_spec = {n: TensorSpec(s, torch.float32) for n, s in TP_MODEL.checkpoint_shapes().items()}
    extra = {n: s for n, s in (spec or {}).items() if engine_spec.get(n) != s}
    if extra:
        raise ManifestMismatch(f"the TP engine serves only its model's tensors; not {sorted(extra)[:5]}")
    return TPReferenceEngine(tp=tp)
