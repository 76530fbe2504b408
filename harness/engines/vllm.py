"""Real vLLM as a harness Engine, and the Receiver that syncs weights into it.

Two forms share one adapter (`VllmEngine`):
- `InProcessVllm`: vLLM's `LLM` in this process, one-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0,
  uni executor): starts in seconds; a harness thread steps the engine and streams tokens.
- `ServerVllm` (harness.engines.vllm_server): the OpenAI-compatible server in dev mode, started as a
  subprocess; everything goes over its HTTP routes, as a trainer would drive it.

Weights move with the harness's own CPU transport, registered into vLLM's weight-transfer factory
(harness.engines.vllm_transport, loaded by vLLM through worker_extension_cls): the trainer side is
the disk path's `DiskSender` (safetensors shards + manifest), and `VllmReceiver` maps the harness
lifecycle one to one onto vLLM's (init_weight_transfer_engine, start_weight_update, update_weights,
finish_weight_update), so `harness.deployment.push()` drives vLLM's own lifecycle.

The oracle (`read_weights`) reads what the model computes with, through the packed CPU kernels, by
checkpoint name; `read_live` gives the same by vLLM's fused names (plus a tied LM head).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from harness.api import (
    ENGINE_UNRESTRICTED,
    JSON,
    PAUSE_MODES,
    BackendError,
    Deployment,
    Engine,
    EngineHandle,
    EngineStateError,
    GenerationRequest,
    LifecycleError,
    ManifestMismatch,
    PauseMode,
    Receiver,
    RequestStream,
    TensorSpec,
    TokenEvent,
    TransferError,
    UnknownTensorError,
    VersionError,
    WeightSpec,
    WeightSyncError,
)
from harness.engines.vllm_layout import FusedLayout
from harness.lifecycle import FAILED, NEW, READY, UPDATING, Lifecycle
from harness.manifest import dtype_from_name
from harness.paths.base import check_against_engine, manifest_of
from harness.paths.disk import DiskSender

# Kept in step with harness.engines.vllm_transport, which cannot be imported without vLLM.
BACKEND = "weightsync_files"
EXTENSION = "harness.engines.vllm_transport.WeightSyncWorkerExtension"

DEFAULT_KV_CACHE_BYTES = 64 << 20  # vLLM on CPU otherwise sizes its KV cache from a share of all RAM
INITIAL_VERSION = "default"  # what vLLM reports before any versioned update

_ERRORS: dict[str, type[WeightSyncError]] = {
    c.__name__: c
    for c in (
        LifecycleError,
        VersionError,
        UnknownTensorError,
        ManifestMismatch,
        TransferError,
        EngineStateError,
    )
}
# vLLM's own lifecycle-order errors (vllm/v1/worker/gpu_worker.py), which carry no harness class name
_VLLM_LIFECYCLE_MESSAGES = (
    "finish_weight_update called without a matching start_weight_update",
    "start_weight_update must be called before update_weights",
    "start_weight_update called while a weight update is already active",
    "Weight transfer not configured",
)
_ERROR_RE = re.compile(r"\b(" + "|".join(_ERRORS) + r"): (.*)", re.DOTALL)


def harness_error(message: str, context: str) -> WeightSyncError:
    """The harness error a vLLM-side failure stands for: the transport prefixes its messages with
    the error class name, which survives both in-process exceptions and HTTP error bodies."""
    for pattern in _VLLM_LIFECYCLE_MESSAGES:
        if pattern in message:
            return LifecycleError(f"{context}: vLLM says: {pattern}")
    m = _ERROR_RE.search(message)
    if m:
        detail = m.group(2).strip().splitlines()[0]
        # vLLM wraps a worker's message as "Worker failed with error '<message>', please check ..."
        detail = re.split(r"'?, please check the stack trace", detail)[0].rstrip("'\"} \\")
        return _ERRORS[m.group(1)](f"{context}: {detail}")
    return TransferError(f"{context}: vLLM failed: {message.strip()[-1500:]}")


def parse_version(raw: str) -> int:
    """vLLM's opaque version string -> the harness's int (the harness only ever sets decimal ones)."""
    if raw in (INITIAL_VERSION, "", None):
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise EngineStateError(
            f"vLLM reports weight version {raw!r}, which the harness did not set"
        ) from None


class VllmEngine(Engine, abc.ABC):
    """What both forms share: the spec, the oracle, versions, and commits through the transport.

    The control plane (the four lifecycle calls, collective_rpc, the prefix cache, pause) is per form.
    Errors from vLLM come back as harness errors (UnknownTensorError, ManifestMismatch, ...)."""

    form: str = "?"
    owns_workdir = False  # remove the workdir at shutdown (engines made by make_engine)
    max_num_seqs: int | None = None  # set by each form from its launch settings

    def __init__(self, model_dir: str | os.PathLike, workdir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spec: dict[str, TensorSpec] | None = None
        self._layout: FusedLayout | None = None
        self._reads = itertools.count()
        self._commit_sender: DiskSender | None = None

    @property
    def max_running_requests(self) -> int | None:
        return self.max_num_seqs

    def model_config(self) -> JSON:
        with open(self.model_dir / "config.json") as f:
            return json.load(f)

    # ------------------------------------------------------------------ control plane (per form)
    @abc.abstractmethod
    def init_weight_transfer_engine(self, init_info: JSON) -> None: ...

    @abc.abstractmethod
    def start_weight_update(self) -> None: ...

    @abc.abstractmethod
    def update_weights(self, update_info: JSON) -> None: ...

    @abc.abstractmethod
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    @abc.abstractmethod
    def collective_rpc(self, method: str, kwargs: JSON | None = None) -> list[Any]: ...

    @abc.abstractmethod
    def vllm_weight_version(self) -> str:
        """The version string vLLM reports (/weight_info on the server)."""

    # ------------------------------------------------------------------ Engine: state
    @property
    def weight_version(self) -> int:
        return parse_version(self.vllm_weight_version())

    def _worker_spec(self) -> JSON:
        results = self.collective_rpc("weightsync_spec")
        if not results:
            raise EngineStateError(f"{self.form} vLLM: weightsync_spec returned nothing")
        return results[0]

    def weight_spec(self) -> dict[str, TensorSpec]:
        """Checkpoint (HF) names, as the worker's transport checks them."""
        if self._spec is None:
            raw = self._worker_spec()
            self._spec = {
                n: TensorSpec(tuple(s["shape"]), dtype_from_name(s["dtype"])) for n, s in raw["spec"].items()
            }
            self._layout = FusedLayout(raw["packed"], self._spec)
        return dict(self._spec)

    @property
    def layout(self) -> FusedLayout:
        """How checkpoint names fuse into vLLM's live parameters for this model."""
        if self._layout is None:
            self.weight_spec()
        assert self._layout is not None
        return self._layout

    def _read(self, layout: str) -> dict[str, torch.Tensor]:
        path = self.workdir / "readback" / f"{os.getpid()}-{next(self._reads)}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.collective_rpc("weightsync_read", {"path": str(path), "layout": layout})
            return safetensors.torch.load_file(str(path))
        finally:
            path.unlink(missing_ok=True)

    def read_weights(self) -> dict[str, torch.Tensor]:
        """Oracle: what the forward pass computes with, by checkpoint name (fused tensors sliced).
        Read through each packed CPU kernel (identity matmul): exact for finite values."""
        return self._read("checkpoint")

    def read_live(self) -> dict[str, torch.Tensor]:
        """The same by vLLM name (qkv_proj, gate_up_proj, and lm_head.weight even when tied)."""
        return self._read("live")

    # ------------------------------------------------------------------ Engine: commit
    def commit_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Install `tensors` as `version` through the transport (a private disk checkpoint)."""
        if self._commit_sender is None:
            self._commit_sender = DiskSender(self.workdir / "commits")
        receiver = VllmReceiver(self)
        receiver.init_transfer_engine(self._commit_sender.init())
        receiver.start_weight_update()
        try:
            receiver.update_weights(self._commit_sender.prepare(version, tensors))
        except BaseException:
            receiver.abort_weight_update()
            raise
        receiver.finish_weight_update(version)

    def discard_update(self) -> None:
        """End an open vLLM update without applying anything: the transport drops what it staged,
        then, if vLLM still holds the update open, an empty finish closes it (the model is untouched
        and the version stays)."""
        results = self.collective_rpc("weightsync_discard")
        if any(r.get("active") for r in results):
            self.finish_weight_update(None)

    def describe(self) -> str:
        return f"vLLM ({self.form}) serving {self.model_dir.name}"


# --------------------------------------------------------------------------------------------- receiver
class VllmReceiver(Receiver):
    """The harness lifecycle mapped one to one onto vLLM's, for `push()`.

    Before anything reaches vLLM it applies the harness's rules (calls in order, a version newer than
    the served one, names and shapes the model has); the worker-side transport then checks the bytes
    (manifest, digests, whole fused groups) before the model is touched.

    `reset_prefix_cache_after_commit`: vLLM 0.32 keeps prefix-cache blocks computed with the old
    weights across an update (see suites/vllm/test_vllm_findings.py), so a trainer must reset it; this
    receiver does, after every commit."""

    reset_prefix_cache_after_commit = True

    def __init__(self, engine: VllmEngine):
        self.engine = engine
        self._lc = Lifecycle()
        self._mutex = threading.Lock()

    @property
    def state(self) -> str:
        return self._lc.state

    def rebind(self, engine: VllmEngine) -> None:
        with self._mutex:
            self.engine = engine
            self._lc.to(NEW)

    def init_transfer_engine(self, init_info: JSON) -> None:
        with self._mutex:
            self._lc.check_init(init_info)
            self.engine.init_weight_transfer_engine(dict(init_info))
            self._lc.to(READY)

    def start_weight_update(self) -> None:
        with self._mutex:
            self._lc.check_start()
            if self._lc.failed:  # vLLM still holds the refused update open: close it first
                self._close_open_update()
            self.engine.start_weight_update()
            self._lc.to(UPDATING)

    def update_weights(self, update_info: JSON) -> None:
        with self._mutex:
            self._lc.check_update()
            try:
                self._lc.check_not_failed()
                manifest = manifest_of(update_info)
                check_against_engine(self.engine, manifest)
                self._lc.check_same_version(manifest.version)
                if "path" not in update_info:
                    raise ManifestMismatch(
                        f"version {manifest.version}: update_info has no checkpoint 'path'"
                    )
                self.engine.update_weights(
                    {"path": str(update_info["path"]), "manifest": update_info["manifest"]}
                )
            except WeightSyncError as exc:
                self._lc.fail(exc)
                raise
            self._lc.accepted(manifest.version)

    def finish_weight_update(self, version: int) -> None:
        with self._mutex:
            if self._lc.failed:
                try:
                    self.engine.discard_update()
                finally:
                    self._lc.check_finish(version)  # raises, naming why the update failed, and closes it
            self._lc.check_finish(version)
            try:
                self.engine.finish_weight_update(str(version))
            finally:
                self._lc.to(READY)
            if self.reset_prefix_cache_after_commit:
                self.engine.reset_prefix_cache()

    def abort_weight_update(self) -> None:
        with self._mutex:
            self._lc.check_abort()
            if self._lc.state in (UPDATING, FAILED):
                self._close_open_update()
            self._lc.to(READY)

    def _close_open_update(self) -> None:
        try:
            self.engine.discard_update()
        finally:
            self._lc.to(READY)

    def shutdown(self) -> None:
        with self._mutex:
            self._lc.to(NEW)


# --------------------------------------------------------------------------------------------- in-process
class InProcessVllm(VllmEngine):
    """vLLM's LLM in this process. vLLM has no serving loop here, so a harness thread steps the
    engine and streams each step's new tokens; lifecycle calls and pause take the same lock, so they
    land between two steps, as they do in vLLM's own engine-core loop.

    Pause goes through vLLM's engine core (pause_scheduler / resume_scheduler). vLLM refuses
    mode "wait" in this one-process mode, so "wait" lets in-flight requests finish first (requests
    submitted meanwhile are held back), then pauses vLLM with nothing in flight."""

    form = "in-process"

    def __init__(
        self,
        model_dir: str | os.PathLike,
        workdir: str | os.PathLike,
        dtype: str = "float32",
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        seed: int = 0,
    ):
        super().__init__(model_dir, workdir)
        self.max_num_seqs = max_num_seqs
        # One process: the engine core runs in this thread's process and the worker is reachable.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._SamplingParams, self._TokensPrompt, self._delta = (
            SamplingParams,
            TokensPrompt,
            RequestOutputKind.DELTA,
        )
        self.llm = LLM(
            model=str(self.model_dir),
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            kv_cache_memory_bytes=kv_cache_bytes,
            distributed_executor_backend="uni",
            worker_extension_cls=EXTENSION,
            weight_transfer_config={"backend": BACKEND},
        )
        self._llm_engine = self.llm.llm_engine
        self._core = self._llm_engine.engine_core.engine_core  # vLLM's EngineCore: its pause API
        self.vocab_size = self._llm_engine.model_config.get_vocab_size()
        self._cond = threading.Condition(threading.RLock())
        self._streams: dict[str, list] = {}  # request id -> [stream, tokens produced]
        self._held: list[GenerationRequest] = []  # submitted during pause("wait"), added after it
        self._held_streams: dict[str, RequestStream] = {}
        self._paused = False
        self._draining = False
        self._stopped = False
        self._failure: BaseException | None = None  # what broke the step loop, if anything
        self._version = parse_version(self._llm_engine.get_weight_version())
        self._thread = threading.Thread(target=self._loop, name="vllm-inprocess", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ control plane
    def _guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        with self._cond:
            if self._stopped:
                raise EngineStateError(f"{what}: the engine is shut down")
            try:
                return fn()
            except WeightSyncError:
                raise
            except Exception as exc:
                raise harness_error(f"{type(exc).__name__}: {exc}", f"{self.form} vLLM {what}") from exc

    def init_weight_transfer_engine(self, init_info: JSON) -> None:
        self._guarded(
            "init_weight_transfer_engine",
            lambda: self.llm.init_weight_transfer_engine({"init_info": init_info}),
        )

    def start_weight_update(self) -> None:
        self._guarded("start_weight_update", self.llm.start_weight_update)

    def update_weights(self, update_info: JSON) -> None:
        self._guarded("update_weights", lambda: self.llm.update_weights({"update_info": update_info}))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        def finish():
            self.llm.finish_weight_update(weight_version=weight_version)
            self._version = parse_version(self._llm_engine.get_weight_version())

        self._guarded("finish_weight_update", finish)

    def collective_rpc(self, method: str, kwargs: JSON | None = None) -> list[Any]:
        return self._guarded(method, lambda: self.llm.collective_rpc(method, kwargs=kwargs or {}))

    def vllm_weight_version(self) -> str:
        with self._cond:
            return self._llm_engine.get_weight_version()

    def reset_prefix_cache(self, reset_running_requests: bool = True) -> None:
        """Drop every cached KV block; with reset_running_requests, running requests' blocks too
        (vLLM preempts them and they recompute), so no block computed with old weights survives."""
        if not self._guarded(
            "reset_prefix_cache", lambda: self._llm_engine.reset_prefix_cache(reset_running_requests)
        ):
            raise EngineStateError(
                f"{self.form} vLLM refused to reset its prefix cache (blocks still in use)"
            )

    # ------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest) -> RequestStream:
        request.check(self.vocab_size)
        stream = RequestStream(request)
        with self._cond:
            if self._stopped:
                raise EngineStateError(f"engine is shut down (step failure: {self._failure!r})")
            if request.request_id in self._streams or request.request_id in self._held_streams:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            if self._draining:
                self._held.append(request)
                self._held_streams[request.request_id] = stream
            else:
                self._add(request, stream)
            self._cond.notify_all()
        return stream

    def _add(self, request: GenerationRequest, stream: RequestStream) -> None:
        params = self._SamplingParams(
            temperature=0.0,
            max_tokens=request.max_tokens,
            ignore_eos=True,
            stop_token_ids=list(request.stop_token_ids),
            output_kind=self._delta,
        )
        prompt = self._TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        self._llm_engine.add_request(request.request_id, prompt, params)
        self._streams[request.request_id] = [stream, 0]

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopped or (bool(self._streams) and (not self._paused or self._draining))
                )
                if self._stopped:
                    return
                try:
                    outputs = self._llm_engine.step()
                except Exception as exc:  # noqa: BLE001 - the engine is broken: end every request, don't hang
                    self._end_all("abort")
                    self._stopped = True
                    self._failure = exc
                    self._cond.notify_all()
                    return
                for out in outputs:
                    self._deliver(out)
                self._cond.notify_all()

    def _deliver(self, out) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        stream, produced = entry
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        finish = completion.finish_reason if out.finished else None
        if finish is not None and finish not in ("length", "stop", "abort"):
            finish = "abort"
        for i, tok in enumerate(tokens):
            last = i == len(tokens) - 1
            stream.push(
                TokenEvent(out.request_id, produced + i, tok, self._version, finish if last else None)
            )
        entry[1] = produced + len(tokens)
        if finish is not None:
            if not tokens:
                stream.push(TokenEvent(out.request_id, entry[1], None, self._version, finish))
            del self._streams[out.request_id]

    def _end_all(self, reason: str) -> None:
        for rid, (stream, produced) in list(self._streams.items()):
            stream.push(TokenEvent(rid, produced, None, self._version, reason))
        self._streams.clear()
        for rid, stream in self._held_streams.items():
            stream.push(TokenEvent(rid, 0, None, self._version, reason))
        self._held.clear()
        self._held_streams.clear()

    # ------------------------------------------------------------------ pause
    def pause(self, mode: PauseMode = "abort", clear_cache: bool = False) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cond:
            if self._stopped:
                raise EngineStateError("engine is shut down")
            if mode == "abort":
                ids = list(self._streams)
                if ids:
                    self._llm_engine.abort_request(ids)  # keeps vLLM's output processor consistent
                self._core.pause_scheduler(mode="abort", clear_cache=clear_cache)
                for rid in ids:
                    stream, produced = self._streams.pop(rid)
                    stream.push(TokenEvent(rid, produced, None, self._version, "abort"))
            elif mode == "wait":
                self._draining = True
                self._cond.notify_all()
                try:
                    self._cond.wait_for(lambda: self._stopped or not self._streams)
                    self._core.pause_scheduler(mode="abort", clear_cache=clear_cache)  # nothing left to abort
                finally:
                    self._draining = False
                held, self._held = self._held, []
                for r in held:  # vLLM queues them while paused
                    self._add(r, self._held_streams.pop(r.request_id))
            else:
                self._core.pause_scheduler(mode="keep", clear_cache=clear_cache)
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._core.resume_scheduler()
            self._paused = False
            self._cond.notify_all()

    @property
    def is_paused(self) -> bool:
        with self._cond:
            return bool(self._core.is_scheduler_paused())

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        with self._cond:
            if self._stopped and not self._thread.is_alive():
                return
            self._stopped = True
            self._end_all("abort")
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._llm_engine.engine_core.shutdown()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


# --------------------------------------------------------------------------------------------- backend
class VllmDeployment(Deployment):
    """A DiskSender wired to one vLLM engine (made by `make_engine`) through a VllmReceiver."""

    def __init__(self, make_engine: Callable[[], VllmEngine], workdir: str | os.PathLike):
        self._make_engine = make_engine
        self.sender = DiskSender(Path(workdir) / "checkpoints")
        self.init_info = self.sender.init()
        engine = make_engine()
        receiver = VllmReceiver(engine)
        receiver.init_transfer_engine(self.init_info)
        self.handles = [EngineHandle(receiver, engine)]

    def reset(self, spec: WeightSpec | None = None) -> None:
        """A fresh engine at version 0 (vLLM cannot be rolled back): restart it."""
        for h in self.handles:
            if spec is not None and dict(spec) != h.engine.weight_spec():
                raise BackendError("vLLM serves a fixed model; a deployment cannot take another weight spec")
            h.engine.shutdown()
            h.engine = self._make_engine()
            h.receiver.rebind(h.engine)  # type: ignore[attr-defined]
            h.receiver.init_transfer_engine(self.init_info)

    def close(self) -> None:
        for h in self.handles:
            h.receiver.shutdown()
            h.engine.shutdown()
        self.sender.shutdown()


def make_engine(spec: WeightSpec | None = None) -> InProcessVllm:
    """Engine factory for `--weightsync-engine=harness.engines.vllm:make_engine`: real vLLM, in
    process, serving the tiny Llama of harness.engines.tiny_hf_models (built once under
    WEIGHTSYNC_MODEL_CACHE, default a folder in the temp dir). Any path delivers into it through `commit_weights`, i.e.
    through vLLM's own lifecycle. vLLM serves a fixed model: a spec must be a subset of its own."""
    from harness.engines.tiny_hf_models import TINY_LLAMA, build

    cache = os.environ.get("WEIGHTSYNC_MODEL_CACHE") or os.path.join(
        tempfile.gettempdir(), "weightsync-models"
    )
    engine = InProcessVllm(build(TINY_LLAMA, cache), tempfile.mkdtemp(prefix="weightsync-vllm-engine-"))
    engine.owns_workdir = True
    if spec is not None:
        own = engine.weight_spec()
        foreign = sorted(n for n, s in spec.items() if own.get(n) != s)
        if foreign:
            engine.shutdown()
            raise BackendError(
                f"vLLM serves a fixed model; it cannot hold {foreign[:5]} "
                f"({len(foreign)} tensor(s) not in its checkpoint spec with that shape and dtype)"
            )
    return engine


#: What real vLLM can be tested for through the generic suites (read by the plugin from the factory).
VLLM_CAPABILITIES = dataclasses.replace(
    ENGINE_UNRESTRICTED,
    dtypes=frozenset({torch.float32}),  # the fixture models are float32
    multi_receiver=False,  # one vLLM per test run on 2 cores
    max_receivers=1,
    arbitrary_tensors=False,  # a fixed model: only its checkpoint names and shapes
)
make_engine.capabilities = VLLM_CAPABILITIES  # type: ignore[attr-defined]
# vLLM's CPU worker binds its OpenMP threads and checks the kernels run with that count: a rank process
# must not pin torch to one thread before vLLM starts ("thread_num == thread_num (2 vs. 1)").
make_engine.manages_threads = True  # type: ignore[attr-defined]


def private_tmpdir(base: str | os.PathLike | None = None) -> Path:
    """A private TMPDIR for vLLM's rendezvous files, made current for this process."""
    path = Path(tempfile.mkdtemp(prefix="weightsync-vllm-", dir=base))
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # re-read TMPDIR
    return path
