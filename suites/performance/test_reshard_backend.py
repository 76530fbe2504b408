"""The reshard backend's bytes against its plan: every engine rank of every replica receives exactly the
plan's minimum for it, and the trainer ranks hand the library R x the plan's total point to point (one
send per replica), the plan's total once on the broadcast plane (one broadcast per engine rank group, what
the backend chooses for 2 replicas or more). Times are printed beside the bytes (GB/s over the engine
ranks' bytes), not gated."""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch
from torch.distributed import HashStore

from harness.api import BackendError, GenerationRequest
from harness.backends.reshard import ReshardBackend
from harness.checks import bitwise_mismatches
from harness.deployment import push
from harness.reshard.collective import NCCL, new_group, placement
from harness.reshard.oracle import expected_engine_shards
from harness.reshard.sync import PLANE_ENV, choose_data_plane

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    ("replicas", "plane"), [(1, "p2p"), (2, "p2p"), (2, "broadcast"), (1, "ipc"), (2, "ipc")]
)
def test_each_engine_rank_receives_the_plans_minimum_bytes(tmp_path, monkeypatch, replicas, plane):
    monkeypatch.setenv(PLANE_ENV, plane)
    backend = ReshardBackend(trainer_ranks=3, tp=2, timeout_s=30.0)
    with backend.deploy(replicas, None, str(tmp_path)) as dep:
        assert dep.sender.plane == plane, (dep.sender.plane, dep.sender.plane_why)
        spec = dep.handles[0].engine.weight_spec()
        plan = dep.sender.plan(list(spec))
        minimum = plan.minimum_bytes()
        gen = torch.Generator().manual_seed(7)
        times = []
        for version in range(1, 6):
            weights = {n: torch.randn(s.shape, generator=gen).to(s.dtype) for n, s in spec.items()}
            t0 = time.perf_counter()
            push(dep, version, weights)
            times.append(time.perf_counter() - t0)
            for q, h in enumerate(dep.handles):
                got = {f"engine {r}": b for r, b in enumerate(h.receiver.received_bytes)}
                want = {k: v for k, v in minimum.items() if k != "total"}
                assert got == want, (
                    f"3 -> 2, replica {q} of {replicas}, version {version}: engine ranks received {got}, the "
                    f"plan's minimum is {want}\n{plan.bytes_table()}\n"
                    "rerun: pytest suites/performance/test_reshard_backend.py"
                )
            sent = sum(dep.sender.sent_bytes)
            # a broadcast hands each transfer over once; on the ipc plane each replica reads its own copy
            copies = 1 if plane == "broadcast" else replicas
            assert sent == copies * minimum["total"], (
                f"the trainer ranks sent {dep.sender.sent_bytes} (sum {sent}) for {replicas} replica(s) on the "
                f"{plane} plane; expected {copies} x {minimum['total']}"
            )
        median = statistics.median(times[1:])
        moved = replicas * minimum["total"]
        print(
            f"reshard 3 -> {replicas} x TP 2 ({plane}): {moved} B per push, median {median * 1e3:.1f} ms "
            f"({moved / median / 1e9:.4f} GB/s), each engine rank at its minimum"
        )


@pytest.mark.parametrize(("plane", "replicas"), [("broadcast", 1), ("bogus", 2)])
def test_a_data_plane_that_cannot_be_is_refused_at_deploy_naming_the_setting(
    tmp_path, monkeypatch, plane, replicas
):
    monkeypatch.setenv(PLANE_ENV, plane)
    with pytest.raises(BackendError, match=PLANE_ENV):
        ReshardBackend(trainer_ranks=3, tp=2, timeout_s=30.0).deploy(replicas, None, str(tmp_path))


def _push_twice_and_check_every_engine_shard(dep, seed: int, also=lambda version, minimum: None) -> None:
    """Push versions 1 and 2 from the GPU into `dep`; after each, every engine rank of every replica received
    the plan's minimum and holds the oracle's cut bit for bit, then `also(version, the plan's minimum)`."""
    spec = dep.handles[0].engine.weight_spec()
    plan = dep.sender.plan(list(spec))
    minimum = plan.minimum_bytes()
    gen = torch.Generator().manual_seed(seed)
    for version in (1, 2):
        weights = {n: torch.randn(s.shape, generator=gen).to(s.dtype).cuda() for n, s in spec.items()}
        push(dep, version, weights)
        full = {n: t.cpu() for n, t in weights.items()}
        for q, h in enumerate(dep.handles):
            got = {f"engine {r}": b for r, b in enumerate(h.receiver.received_bytes)}
            assert got == {k: v for k, v in minimum.items() if k != "total"}, (version, q, got, minimum)
            for r, shards in enumerate(h.engine.read_shards()):
                want = expected_engine_shards(full, plan.engine, r)
                wrong = bitwise_mismatches({n: want[n] for n in shards}, shards)
                assert not wrong, f"version {version}, replica {q}, engine rank {r}: {wrong[:3]}"
        also(version, minimum)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("replicas", [1, 2])
def test_on_one_gpu_engine_ranks_read_the_trainer_ranks_shards_over_cuda_ipc(tmp_path, monkeypatch, replicas):
    """The GPU variant: every trainer and engine rank on the one GPU, the ipc plane chosen by itself; each
    engine rank's live shards live on the device and are the oracle's cut bit for bit, each at the plan's
    minimum bytes, and the engine computes with them."""
    monkeypatch.delenv(PLANE_ENV, raising=False)
    backend = ReshardBackend(trainer_ranks=3, tp=2, timeout_s=60.0, device="cuda:0")
    assert (backend.ceiling, backend.capabilities.gpu) == ("device-copy", True)
    with backend.deploy(replicas, None, str(tmp_path)) as dep:
        assert dep.sender.plane == "ipc", (dep.sender.plane, dep.sender.plane_why)

        def on_the_device_and_sent_once_per_replica(version: int, minimum: dict) -> None:
            for h in dep.handles:
                live = h.engine.rank.live
                assert all(t.is_cuda for t in live.values()), {n: t.device for n, t in live.items()}
                assert h.engine.weight_version == version
            assert sum(dep.sender.sent_bytes) == replicas * minimum["total"], dep.sender.sent_bytes

        _push_twice_and_check_every_engine_shard(dep, 11, on_the_device_and_sent_once_per_replica)
        (done,) = dep.handles[0].engine.generate([GenerationRequest("gpu", (1, 2, 3), 4)])
        print(f"reshard 3 -> {replicas} x TP 2 on {torch.cuda.get_device_name()}: ipc plane, {done}")
        assert len(done.token_ids) == 4, done


def test_a_world_whose_engine_never_joins_is_named_and_formed_again_once(tmp_path, monkeypatch):
    """An engine whose join never returns (the H100 run saw a leader that never registered): the deployment
    does not wait on it for good; it names where the join stood, replaces that engine, and the fresh
    world syncs."""
    from harness.backends import reshard
    from harness.engines.tp_reference import TPReferenceEngine

    monkeypatch.setattr(reshard, "JOIN_S", 3.0)
    monkeypatch.setattr(reshard, "JOIN_GRACE_S", 2.0)
    joins, join = [], TPReferenceEngine.join_world

    def first_join_of_engine_1_hangs(self, world):
        joins.append(world["base"])
        if len(joins) == 2:
            threading.Event().wait()  # never returns
        return join(self, world)

    monkeypatch.setattr(TPReferenceEngine, "join_world", first_join_of_engine_1_hangs)
    with pytest.warns(RuntimeWarning, match="had not returned, at:(.|\n)*first_join_of_engine_1_hangs"):
        dep = ReshardBackend(trainer_ranks=3, tp=2, timeout_s=10.0).deploy(2, None, str(tmp_path))
    with dep:
        spec = dep.handles[0].engine.weight_spec()
        push(dep, 1, {n: torch.randn(s.shape) for n, s in spec.items()})
        assert [h.engine.weight_version for h in dep.handles] == [1, 1]
        assert dep.restarts >= 1, dep.restarts


# ------------------------------------------------------------------ a GPU per rank: the NCCL variant
@pytest.mark.parametrize(
    ("device", "gpus", "want"),
    [
        ("cpu", 0, ("gloo", ["cpu"] * 7)),
        ("cuda", 1, ("gloo", ["cuda"] * 7)),  # one GPU for all: the ipc plane, gloo forms the world
        ("cuda", 6, ("gloo", ["cuda"] * 7)),  # one GPU short of a GPU per rank
        ("cuda", 8, ("nccl", [f"cuda:{i}" for i in range(7)])),
    ],
)
def test_a_world_takes_nccl_only_with_a_gpu_per_rank(device, gpus, want):
    assert placement(7, device, gpus) == want, (device, gpus, placement(7, device, gpus))


def test_with_a_gpu_per_rank_the_plane_moves_messages_over_nccl_and_says_so():
    for replicas, plane in ((1, "p2p"), (2, "broadcast")):
        got, why = choose_data_plane(replicas, "cuda", NCCL)
        assert got == plane and "NCCL" in why, (replicas, got, why)
    assert choose_data_plane(2, "cuda")[0] == "ipc"  # one GPU for every rank


def test_on_a_host_with_a_gpu_per_rank_the_backend_declares_the_nccl_ceiling(monkeypatch):
    from harness.backends import reshard

    monkeypatch.setattr(reshard, "gpu_count", lambda device: 8)  # 3 + 2 x 2 ranks: 7 GPUs needed
    backend = ReshardBackend(trainer_ranks=3, tp=2, device="cuda")
    assert (backend.collective, backend.ceiling) == ("nccl", "nccl"), backend.floor_reason
    monkeypatch.setattr(reshard, "gpu_count", lambda device: 6)
    assert ReshardBackend(trainer_ranks=3, tp=2, device="cuda").ceiling == "device-copy"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a host without a GPU")
def test_an_nccl_world_on_a_host_without_gpus_is_refused_naming_the_rank():
    import datetime

    store = HashStore()
    with pytest.raises(BackendError, match="rank 3 has 'cuda:3'.*0 GPU"):
        new_group(NCCL, store, 3, 7, datetime.timedelta(seconds=5), "cuda:3")
    with pytest.raises(BackendError, match="not 'mpi'"):
        new_group("mpi", store, 0, 1, datetime.timedelta(seconds=5))


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 7, reason="needs a GPU per rank: 3 trainer ranks + 2 engines x TP 2 = 7 GPUs"
)
@pytest.mark.parametrize("replicas", [1, 2])
def test_with_a_gpu_per_rank_each_engine_rank_receives_its_shards_over_nccl(tmp_path, monkeypatch, replicas):
    """The NCCL variant: every trainer and engine rank on a GPU of its own; each engine rank's live shards
    on its GPU are the oracle's cut bit for bit, each at the plan's minimum bytes."""
    monkeypatch.delenv(PLANE_ENV, raising=False)
    backend = ReshardBackend(trainer_ranks=3, tp=2, timeout_s=60.0, device="cuda")
    assert backend.ceiling == "nccl", backend.floor_reason
    with backend.deploy(replicas, None, str(tmp_path)) as dep:
        assert dep.collective == "nccl" and dep.sender.plane in ("p2p", "broadcast"), dep.sender.plane_why

        def each_leader_on_its_own_gpu(version: int, minimum: dict) -> None:
            for q, h in enumerate(dep.handles):
                leader = {str(t.device) for t in h.engine.rank.live.values()}
                assert leader == {dep.devices[3 + 2 * q]}, (version, q, leader, dep.devices)

        _push_twice_and_check_every_engine_shard(dep, 13, each_leader_on_its_own_gpu)
