"""The resharded sync as a path: a `Sender` that drives N trainer rank processes and a `Receiver` per
tensor-parallel engine (M ranks), vLLM's lifecycle over the plan.

    prepare(v, tensors)   the full tensors written once to /dev/shm (a trainer rank maps it and reads only
                          its Shard(0) rows); update_info: the version, its names, the planner
    transmit()            every trainer rank sends its planned transfers (`sync.send_shards`) to each replica
    update_weights(info)  every engine rank receives its transfers into fresh shards and stages them
                          (`TPReferenceEngine.receive_staged`); a version the engine refuses is still
                          received (the trainer ranks' sends must land somewhere), then dropped
    finish(v)             vote-then-swap on every engine rank (`commit_staged`): all ranks or none

The receiver's engine is duck-typed (this layer sits below the engines): `receive_staged`, `commit_staged`,
`discard_staged`, `check_update`, `layout`."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping

import torch

from harness.api import (
    JSON,
    LifecycleError,
    ManifestMismatch,
    RankFailure,
    Receiver,
    Sender,
    TensorSpec,
    UnknownTensorError,
    WeightSyncError,
)
from harness.lifecycle import FAILED, NEW, READY, UPDATING, Lifecycle
from harness.manifest import digests, dtype_name
from harness.paths.ipc import sweep_abandoned_segments
from harness.reshard.collective import GLOO
from harness.reshard.ipc_plane import SharedBuffer
from harness.reshard.layout import DTYPES, ModelShape
from harness.reshard.oracle import expected_engine_shards
from harness.reshard.plan import plan_for_names, planner_path
from harness.reshard.sync import BROADCAST, data_plane
from harness.reshard.trainer_ranks import SEND, TrainerRanks


class ReshardSender(Sender):
    """The trainer's side: `ranks` (N trainer rank processes) send to `replicas` engines of `engines` TP
    ranks each; `model` and `dtype` fix what a version may hold."""

    def __init__(
        self,
        ranks: TrainerRanks,
        model: ModelShape,
        dtype: str,
        engines: int,
        replicas: int,
        timeout_s: float,
        device: str = "cpu",
        collective: str = GLOO,
    ):
        self.ranks, self.model, self.dtype, self.device = ranks, model, dtype, torch.device(device)
        self.engines, self.replicas, self.timeout_s = engines, replicas, timeout_s
        self.spec = {n: TensorSpec(s, DTYPES[dtype]) for n, s in model.checkpoint_shapes().items()}
        #: where the trainer ranks read a version from: a /dev/shm file, on a GPU a device buffer
        self.staging = SharedBuffer("staging", self.device)
        self._send: dict | None = None
        #: bytes each trainer rank sent in the last transmit (all replicas), rank 0 first
        self.sent_bytes: list[int] = []
        #: the data plane (p2p: each transfer sent to every replica; broadcast: once per engine rank group)
        self.plane, self.plane_why = data_plane(replicas, device=str(self.device), collective=collective)
        self.planner = planner_path()
        sweep_abandoned_segments()  # a trainer SIGKILLed mid-push could not remove its version's file

    def init(self) -> JSON:
        return {}

    def plan(self, names) -> object:
        """The plan of a version holding `names` (the one every rank computes for itself)."""
        return plan_for_names(self.model, self.ranks.n, self.engines, self.dtype, names, self.planner)

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        self._release()
        names = list(named_tensors)
        unknown = sorted(n for n in names if n not in self.spec)
        if unknown:
            raise UnknownTensorError(f"version {version}: unknown tensor(s) {unknown[:5]}")
        layout, offset, tensors = {}, 0, {}
        for name in names:
            t = named_tensors[name]
            s = self.spec[name]
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise ManifestMismatch(
                    f"version {version}: tensor {name!r} is {tuple(t.shape)} {dtype_name(t.dtype)}, the "
                    f"engines hold {s.shape} {dtype_name(s.dtype)}"
                )
            tensors[name] = t
            layout[name] = [offset, list(s.shape)]
            offset += t.numel() * t.element_size()
        flat = self.staging.get(max(offset, 1))
        for name, (at, _) in layout.items():
            # read again to move it, as every path reads a version twice (its manifest, then its bytes)
            t = named_tensors[name].detach()
            n = t.numel() * t.element_size()
            if n:
                flat[at : at + n].copy_(t.to(flat.device).contiguous().reshape(-1).view(torch.uint8))
        if flat.is_cuda:  # the trainer ranks read it from other processes: the copies must have landed
            torch.cuda.synchronize(flat.device)
        sync = secrets.token_hex(8)  # this update's name in the world's store (the ipc plane's keys)
        self._send = {
            "version": version,
            "sync": sync,
            "names": names,
            "staging": self.staging.ref,
            "layout": layout,
            "dtype": self.dtype,
            "model": dataclasses.asdict(self.model),
            "trainers": self.ranks.n,
            "engines": self.engines,
            "replicas": self.replicas,
            "planner": self.planner,
        }
        manifest = {"version": version, "entries": self.expected_digests(names, tensors)}
        return {
            "version": version,
            "sync": sync,
            "names": names,
            "trainers": self.ranks.n,
            "planner": self.planner,
            "manifest": manifest,
        }

    def expected_digests(self, names: list[str], tensors: Mapping[str, torch.Tensor]) -> list[JSON]:
        """[{rank, name, digest}]: what each engine rank's shard of each live parameter must hash to, cut
        from the full tensors by the oracle (none of the plan's arithmetic): every engine rank checks what
        it received against its own before it stages anything."""
        plan = self.plan(names)
        # cut and hashed where the engines hold their shards (on a GPU: no host copy, ws64x2 on the device)
        full = {n: tensors[n].detach().to(self.device) for n in names}
        tied = plan.tied()
        with torch.device(self.device):  # the oracle's padding rows beside the rest
            cuts = [
                (r, live, t)
                for r in range(self.engines)
                for live, t in expected_engine_shards(full, plan.engine, r).items()
                if live not in tied
            ]
        hashed = digests([t for _, _, t in cuts])
        return [{"rank": r, "name": live, "digest": d} for (r, live, _), d in zip(cuts, hashed, strict=True)]

    def expected_sent(self, plan_total: int) -> int:
        """What the trainer ranks hand the library per version for a plan moving `plan_total` bytes into
        one replica: every replica's copy point to point (on the ipc plane every replica's engine ranks
        read their own copy out of the trainer ranks' buffers), one copy on the broadcast plane."""
        return plan_total if self.plane == BROADCAST else self.replicas * plan_total

    def transmit(self) -> None:
        if self._send is None:
            raise LifecycleError("transmit before prepare")
        self.sent_bytes = self.ranks.call(SEND, [self._send] * self.ranks.n, self.timeout_s)

    def complete(self, committed: bool) -> None:
        """The file is kept for the next version after a commit (the ranks read it only while sending)."""
        self._send = None
        if not committed:
            self.staging.release()

    def _release(self) -> None:
        self._send = None

    def diagnose(self) -> list[str]:
        return [self.ranks.describe(r) for r in range(self.ranks.n) if not self.ranks.alive(r)]

    def shutdown(self) -> None:
        self._send = None
        self.staging.release()


class ReshardReceiver(Receiver):
    """One TP engine's side: its ranks receive their planned transfers and commit together. `name` is how
    its errors name it (the deployment's name for its engine)."""

    def __init__(self, engine, name: str = "engine"):
        self.engine, self.name = engine, name
        self.lifecycle = Lifecycle()
        self._names: list[str] = []
        #: bytes each engine rank received in the last update, rank 0 first
        self.received_bytes: list[int] = []

    def rebind(self, engine) -> None:
        """A fresh engine (its predecessor failed): nothing of an open update survives it."""
        self.engine = engine
        if self.lifecycle.state != NEW:
            self.lifecycle.to(READY)

    def init_transfer_engine(self, init_info: JSON) -> None:
        self.lifecycle.check_init(init_info)
        if "world" in init_info:
            self._named(self.engine.join_world, init_info["world"])
        self.lifecycle.to(READY)

    def start_weight_update(self) -> None:
        self.lifecycle.check_start()
        self._named(self.engine.discard_staged)
        self.lifecycle.to(UPDATING)

    def update_weights(self, update_info: JSON) -> None:
        """Receive the version whatever the engine thinks of it (the trainer ranks send regardless), then
        refuse it, dropping what arrived, if the lifecycle or the engine refuses it."""
        refusal: WeightSyncError | None = None
        try:
            self.lifecycle.check_update()
            self.lifecycle.check_not_failed()
        except WeightSyncError as exc:
            refusal = exc
        try:
            version, names, trainers, planner, digests = _parse(update_info)
            sync = update_info.get("sync")
        except ManifestMismatch as exc:  # nothing to receive by: the lifecycle's refusal first
            if refusal is None:
                self.lifecycle.fail(exc)
            raise refusal or exc from None
        if refusal is None:
            try:
                self.engine.check_update(names, version)
                self.lifecycle.check_same_version(version)
                if self.lifecycle.version is not None:
                    raise ManifestMismatch(
                        f"version {version} was already received in this update: a resharded version "
                        "arrives whole in one update_weights (every engine rank's shards at once)"
                    )
            except WeightSyncError as exc:
                refusal = exc
        try:
            self.received_bytes = self._named(
                self.engine.receive_staged, version, names, trainers, planner, digests, sync
            )
        except WeightSyncError as exc:
            if self.lifecycle.state in (UPDATING, FAILED):
                self.lifecycle.fail(exc)
            raise
        if refusal is not None:
            self._named(self.engine.discard_staged)
            if self.lifecycle.state in (UPDATING, FAILED):
                self.lifecycle.fail(refusal)
            raise refusal
        self.lifecycle.accepted(version)
        self._names = [
            p.name
            for p in self.engine.layout.params
            if p.tied_to is None and all(s in names for s in p.sources)
        ]

    def finish_weight_update(self, version: int) -> None:
        self.lifecycle.check_finish(version)
        try:
            self._named(self.engine.commit_staged, version, self._names)
        finally:
            self.lifecycle.to(READY)

    def abort_weight_update(self) -> None:
        self.lifecycle.check_abort()
        try:
            self._named(self.engine.discard_staged)
        finally:
            self.lifecycle.to(READY)

    def _named(self, fn, *args):
        """`fn(*args)`, its error saying which engine raised it (the fault checks look for the name); an
        engine that failed (a rank died or hung) is a RankFailure: the deployment replaces it."""
        try:
            return fn(*args)
        except WeightSyncError as exc:
            if getattr(self.engine, "failure", None) is not None and not isinstance(exc, RankFailure):
                raise RankFailure(f"{self.name}: {exc}") from exc
            if self.name not in str(exc):
                exc.args = (f"{self.name}: {exc}", *exc.args[1:])
            raise


def _parse(update_info: JSON) -> tuple[int, list[str], int, str, list]:
    """(version, names, trainer ranks, planner, the manifest's digests) of an update_info, or
    ManifestMismatch saying what is wrong."""
    if not isinstance(update_info, Mapping):
        raise ManifestMismatch(f"update_info must be a mapping, got {type(update_info).__name__}")
    version, names = update_info.get("version"), update_info.get("names")
    trainers, planner = update_info.get("trainers"), update_info.get("planner")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestMismatch(f"update_info: version must be an int, got {version!r}")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ManifestMismatch(f"update_info: names must be a list of tensor names, got {names!r}"[:300])
    if not isinstance(trainers, int) or trainers < 1 or not isinstance(planner, str):
        raise ManifestMismatch(f"update_info: trainers {trainers!r} and planner {planner!r} are required")
    manifest = update_info.get("manifest")
    entries = manifest.get("entries") if isinstance(manifest, Mapping) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, Mapping) and {"rank", "name", "digest"} <= set(e) for e in entries
    ):
        raise ManifestMismatch(f"update_info: version {version}: no manifest of shard digests")
    return version, names, trainers, planner, [dict(e) for e in entries]
