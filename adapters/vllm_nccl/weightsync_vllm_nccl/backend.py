"""vLLM's own `nccl` weight transfer, unmodified, as a weightsync backend.

Both ends are vLLM's code: the trainer side is `NCCLTrainerWeightTransferEngine`
(vllm/distributed/weight_transfer/nccl_engine.py) talking to the engine through vLLM's
`HTTPVLLMWeightSyncClient` (clients.py); the engine is vLLM's dev-mode server started with
`--weight-transfer-config '{"backend": "nccl"}'`, so its worker runs `NCCLWeightTransferEngine`.

vLLM's trainer engine owns the whole round, so the harness's calls map onto it like this:
- deploy: the server starts; `Sender.init()` is vLLM's `trainer_init`, which calls the engine's
  /init_weight_transfer_engine itself while it opens rank 0 of the group (both must rendezvous).
- push: `Sender.prepare(version, tensors)` checks the version against the engine and makes the tensors
  the WeightSource's next round; `Sender.transmit()` is vLLM's `send_weights()`: /start_weight_update,
  /update_weights concurrently with its broadcast, /finish_weight_update labelled with the version.
  The receiver keeps the harness's lifecycle rules and, after finish, resets the prefix cache (vLLM keeps
  stale blocks across an update: suites/vllm/test_vllm_findings.py).

The harness's worker extension stays loaded in the server: the oracle reads the weights through it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)

from harness.api import (
    DEFAULT_TIMEOUT_S,
    JSON,
    Backend,
    BackendError,
    Capabilities,
    Deployment,
    DeployRequest,
    EngineHandle,
    Receiver,
    Sender,
    TransferError,
    WeightSpec,
)
from harness.engines.vllm_server import ServerVllm, free_port
from harness.lifecycle import NEW, READY, UPDATING, Lifecycle
from harness.manifest import Manifest
from harness.paths.base import check_against_engine, manifest_of

VLLM_BACKEND = "nccl"
WORLD_SIZE = 2  # the trainer (rank 0) and one vLLM worker (tensor parallel 1, rank_offset 1)


class NcclInitError(TransferError):
    """vLLM's nccl engine could not join trainer and engine in one group (`trainer_init` failed)."""


# --------------------------------------------------------------------------------------------- engine
class NcclServerVllm(ServerVllm):
    """ServerVllm (routes, oracle, versions) over a dev-mode server whose weight-transfer engine is vLLM's
    nccl."""

    def __init__(self, model_dir, workdir, owns_workdir: bool = False):
        super().__init__(model_dir, workdir, weight_transfer=VLLM_BACKEND)
        self.owns_workdir = owns_workdir

    def shutdown(self) -> None:
        super().shutdown()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


#: vLLM's ZMQ sockets live at <server workdir>/tmp/<36-character uuid> (VllmServerProcess sets TMPDIR), and a
#: unix socket path longer than 107 characters stops the server before it is healthy.
SOCKET_PATH_MAX = 107


def engine_dir(workdir: str | os.PathLike, n: int) -> tuple[Path, bool]:
    """Where the n-th server of a deployment runs, and whether it is a scratch directory of its own: under
    `workdir` when vLLM's socket paths fit there, else a short one under /tmp (removed at shutdown)."""
    path = Path(workdir) / f"nccl-{n}"
    if len(str(path / "tmp")) + 1 + 36 <= SOCKET_PATH_MAX:
        return path, False
    return Path(tempfile.mkdtemp(prefix=f"wsnccl-{n}-", dir="/tmp")), True


# --------------------------------------------------------------------------------------------- trainer
class VersionSource(WeightSource):
    """vLLM's WeightSource over the version prepare() staged: send_weights() replays it each round."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self.tensors.items()))


class LabellingClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client; finish carries the version being pushed (send_weights() passes none), and the
    engine's answer to a failed call is kept (vLLM's trainer_init drops the engine side's error)."""

    def __init__(self, base_url: str, timeout: float):
        super().__init__(base_url, timeout=timeout)
        self.version: int | None = None
        self.failures: list[str] = []

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        try:
            super()._post(path, json)
        except Exception as exc:
            body = getattr(getattr(exc, "response", None), "text", "") or ""
            self.failures.append(f"/{path}: {type(exc).__name__}: {exc} {body[:800]}".strip())
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        label = weight_version if weight_version is not None else self.version
        super().finish_weight_update(None if label is None else str(label))


class NcclSender(Sender):
    """The trainer side: vLLM's NCCLTrainerWeightTransferEngine, driven as vLLM documents it."""

    def __init__(self, engine: ServerVllm, timeout_s: float):
        self.engine = engine
        self.timeout_s = timeout_s
        self.source = VersionSource()
        self.client = LabellingClient(engine.server.url, timeout=timeout_s)
        self.trainer: NCCLTrainerWeightTransferEngine | None = None

    def init(self) -> JSON:
        info = NCCLTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=WORLD_SIZE, rank=0
        )
        where = f"{info.master_address}:{info.master_port}, world_size {info.world_size}"
        try:
            self.trainer = _within(
                self.timeout_s + 10,
                f"vLLM's nccl trainer_init ({where})",
                lambda: NCCLTrainerWeightTransferEngine.trainer_init(
                    info, client=self.client, source=self.source
                ),
            )
        except TransferError:
            raise
        except Exception as exc:
            error = NcclInitError(f"vLLM's nccl trainer_init ({where}) failed: {type(exc).__name__}: {exc}")
            for failure in self.client.failures:
                error.add_note(f"the engine answered {failure}")
            raise error from exc
        return {"backend": VLLM_BACKEND, "master_port": info.master_port}

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        # vLLM's engine loads whatever arrives: refuse here, before send_weights() starts a round
        manifest = Manifest.build(version, named_tensors)
        check_against_engine(self.engine, manifest)
        self.source.tensors = {n: t.detach().contiguous() for n, t in named_tensors.items()}
        self.client.version = version
        return {"manifest": manifest.to_json()}

    def transmit(self) -> None:
        if self.trainer is None:
            raise NcclInitError("transmit before init: vLLM's nccl trainer_init never succeeded")
        try:
            self.trainer.send_weights()
        except Exception as exc:
            error = TransferError(f"vLLM's nccl send_weights failed: {type(exc).__name__}: {exc}")
            for failure in self.client.failures[-3:]:
                error.add_note(f"the engine answered {failure}")
            raise error from exc

    def complete(self, committed: bool) -> None:
        self.source.tensors = {}
        self.client.version = None

    def shutdown(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None


def _within(seconds: float, what: str, fn: Callable[[], Any]) -> Any:
    """fn() on a daemon thread; TransferError if it has not returned in `seconds` (a rendezvous whose peer
    never comes waits in vLLM's TCPStore or NCCL, with no deadline of its own that we control)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name="vllm-nccl-init", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TransferError(f"{what}: still running after {seconds:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


# --------------------------------------------------------------------------------------------- engine side
class NcclReceiver(Receiver):
    """The harness's lifecycle rules; vLLM's trainer engine moves and commits the bytes (in transmit)."""

    def __init__(self, engine: ServerVllm):
        self.engine = engine
        self._lc = Lifecycle()

    def init_transfer_engine(self, init_info: JSON) -> None:
        self._lc.check_init(init_info)  # the engine side was initialised by vLLM's trainer_init
        self._lc.to(READY)

    def start_weight_update(self) -> None:
        self._lc.check_start()
        self._lc.to(UPDATING)

    def update_weights(self, update_info: JSON) -> None:
        self._lc.check_update()
        manifest = manifest_of(update_info)
        self._lc.check_same_version(manifest.version)
        self._lc.accepted(manifest.version)

    def finish_weight_update(self, version: int) -> None:
        self._lc.check_finish(version)
        self._lc.to(READY)
        served = self.engine.weight_version
        if served != version:
            raise TransferError(
                f"vLLM's nccl round for version {version} returned, but the engine serves version {served}"
            )
        self.engine.reset_prefix_cache()

    def abort_weight_update(self) -> None:
        self._lc.check_abort()
        self._lc.to(READY)

    def shutdown(self) -> None:
        self._lc.to(NEW)


# --------------------------------------------------------------------------------------------- deployment
class NcclDeployment(Deployment):
    """One vLLM server (nccl backend) and vLLM's trainer engine joined to it."""

    def __init__(self, make_engine: Callable[[], ServerVllm], timeout_s: float):
        self._make_engine = make_engine
        self.timeout_s = timeout_s
        self.handles = []
        self._connect(make_engine())

    def _connect(self, engine: ServerVllm) -> None:
        try:
            self.sender = NcclSender(engine, self.timeout_s)
            receiver = NcclReceiver(engine)
            receiver.init_transfer_engine(self.sender.init())
        except BaseException:
            engine.shutdown()
            raise
        self.handles = [EngineHandle(receiver, engine)]

    def reset(self, spec: WeightSpec | None = None) -> None:
        """A fresh server at version 0 and a fresh group (vLLM's group is unusable after a failed round)."""
        if spec is not None and dict(spec) != self.handles[0].engine.weight_spec():
            raise BackendError("vLLM serves a fixed model; a deployment cannot take another weight spec")
        self.close()
        self._connect(self._make_engine())

    def recover(self) -> None:
        self.reset()

    def close(self) -> None:
        self.sender.shutdown()
        for h in self.handles:
            h.receiver.shutdown()
            h.engine.shutdown()


class VllmNcclBackend(Backend):
    name = "vllm-nccl"
    # one vLLM engine serving a fixed float32 model; no tap in vLLM's broadcast, no bucket size of ours
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32}), arbitrary_tensors=False, multi_receiver=False, max_receivers=1
    )
    ceiling = "nccl"

    def __init__(self, model_dir: str | os.PathLike | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.model_dir = model_dir
        self.timeout_s = timeout_s

    def build(self, request: DeployRequest) -> Deployment:
        """`request.engine` is not used: the engine is always vLLM's server, its side is what is certified."""
        if request.n_receivers != 1:
            raise BackendError(
                f"{self.name} drives one vLLM engine (world_size {WORLD_SIZE}), not {request.n_receivers}"
            )
        workdir, spec = request.workdir, request.spec
        model_dir = self.model_dir or _tiny_llama()
        runs = itertools.count()

        def make_engine() -> ServerVllm:
            server = NcclServerVllm(model_dir, *engine_dir(workdir, next(runs)))
            foreign = sorted(n for n, s in (spec or {}).items() if server.weight_spec().get(n) != s)
            if foreign:
                server.shutdown()
                raise BackendError(f"vLLM serves a fixed model; it cannot hold {foreign[:5]}")
            return server

        return NcclDeployment(make_engine, self.timeout_s)


def _tiny_llama() -> Path:
    """The vLLM tier's tiny Llama, built once under WEIGHTSYNC_MODEL_CACHE (as harness.engines.vllm does)."""
    from harness.engines.tiny_hf_models import TINY_LLAMA, build

    cache = os.environ.get("WEIGHTSYNC_MODEL_CACHE") or os.path.join(
        tempfile.gettempdir(), "weightsync-models"
    )
    return build(TINY_LLAMA, cache)


def make_backend() -> VllmNcclBackend:
    """The factory `weightsync certify --backend weightsync_vllm_nccl:make_backend` calls."""
    return VllmNcclBackend()
