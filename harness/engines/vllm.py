"""Real vLLM as a harness Engine, in this process (`InProcessVllm`), and its engine factory.

The pieces live in rooms of their own:
- harness.engines.vllm_adapter: `VllmEngine`, what both forms share (spec, oracle, versions, commits,
  vLLM's errors as harness errors);
- harness.engines.vllm_receiver: `VllmReceiver`, the harness lifecycle mapped one to one onto vLLM's,
  and `VllmDeployment`;
- harness.engines.vllm_settings: the launch settings shared with the server form;
- harness.engines.vllm_server: `ServerVllm`, the OpenAI-compatible server in dev mode, started as a
  subprocess and driven over its HTTP routes, as a trainer would drive it.

`InProcessVllm` is vLLM's `LLM` in this process, one-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0,
uni executor): it starts in seconds; a harness thread steps the engine and streams tokens.

`make_engine` recycles: shutting down an engine it made puts that engine's vLLM back to a fresh one's state
(requests aborted, not paused, no update open, the checkpoint reloaded through the transport and read back
bit for bit, version "default", prefix cache empty, the transport's roots forgotten) and the next
`make_engine` in this process serves from it (`release_spare` shuts it down instead). A suite resets its
engines before every test (`Deployment.reset`: shutdown, then make_engine); a new `LLM` each time cost 2-3 s
of every conformance test on 2 cores. Anything that cannot be put back for certain (the step loop broke, a
read-back differs) is shut down, and the next engine is a new `LLM`
(suites/vllm/test_vllm_engine_factory.py checks the engine after a recycle).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch

from harness.api import (
    ENGINE_UNRESTRICTED,
    JSON,
    PAUSE_MODES,
    EngineStateError,
    GenerationRequest,
    PauseMode,
    RequestStream,
    TokenEvent,
    WeightSpec,
    WeightSyncError,
)
from harness.engines.tiny_hf_models import load_checkpoint
from harness.engines.vllm_adapter import (
    VllmEngine,
    harness_error,
    parse_version,
    refuse_foreign_spec,
    tiny_model_dir,
)
from harness.engines.vllm_constants import INITIAL_VERSION
from harness.engines.vllm_settings import DEFAULT_KV_CACHE_BYTES, VllmSettings, cpu_thread_binding
from harness.paths.disk import DiskSender

#: What a rank's warm fork server imports for this engine (harness.warm.engine_preload): vLLM's own import
#: takes seconds (16 s on a loaded 2-core host), which every rank (re)start would pay again. The second
#: line: what an engine's build imports on first use (its CPU worker and model classes: 28 % of a build's
#: CPU samples in the vLLM fault matrix's ranks; they start no thread).
WARM_PRELOAD = (
    "vllm.entrypoints.llm", "vllm.inputs", "vllm.sampling_params",
    "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker", "vllm.v1.sample.rejection_sampler",
    "vllm.model_executor.layers.quantization.online.base", "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
)  # fmt: skip


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
        tensor_parallel_size: int = 1,
        llm: Any = None,
    ):
        """`llm`: a vLLM `LLM` started with these settings and restored to a fresh state (make_engine's
        recycling); None starts a new one."""
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
        if tensor_parallel_size > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") in ("", "auto"):
            # vLLM's "auto" refuses 2 workers on one NUMA node. vLLM caches its environment once an engine
            # has started (vllm.envs.enable_envs_cache): after an earlier engine in this process the new value
            # is read only once that cache is cleared (measured: TP=2 refused after a TP=1 engine)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size)
            import vllm.envs

            cached = getattr(vllm.envs, "__getattr__", None)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()
        settings = VllmSettings(
            dtype,
            max_model_len,
            max_num_seqs,
            kv_cache_bytes,
            seed,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.llm = llm if llm is not None else LLM(**settings.llm_kwargs(self.model_dir))
        self.recyclable = False  # make_engine's engines: shutdown restores the LLM for the next one
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
            in_flight = list(self._streams)
            self._end_all("abort")
            self._cond.notify_all()
        self._thread.join(timeout=30)
        global _spare
        if (
            self.recyclable
            and self._failure is None
            and not self._thread.is_alive()
            and self._restore(in_flight)
        ):
            _spare = self.llm
        else:
            self._llm_engine.engine_core.shutdown()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _restore(self, in_flight: list[str]) -> bool:
        """Put this stopped engine's vLLM back to a fresh engine's state; True once every part of it was
        checked (the weights read back through the kernels equal the checkpoint bit for bit)."""
        llm, core = self.llm, self._llm_engine
        try:
            if in_flight:
                core.abort_request(in_flight)
            if self._core.is_scheduler_paused():
                self._core.resume_scheduler()
            if any(r.get("active") for r in llm.collective_rpc("weightsync_discard")):
                llm.finish_weight_update(weight_version=None)  # closes the open update, applies nothing
            base = load_checkpoint(self.model_dir)
            sender = DiskSender(self.workdir / "restore")
            llm.init_weight_transfer_engine({"init_info": sender.init()})
            llm.start_weight_update()
            llm.update_weights({"update_info": sender.prepare(1, base)})
            llm.finish_weight_update(weight_version=INITIAL_VERSION)
            if not core.reset_prefix_cache(True):
                return False
            path = self.workdir / "restore" / "readback.safetensors"
            llm.collective_rpc("weightsync_read", kwargs={"path": str(path), "layout": "checkpoint"})
            back = safetensors.torch.load_file(str(path))
            llm.shutdown_weight_transfer_engine()  # forgets every root it was given; refused mid-update
            return (
                not core.has_unfinished_requests()
                and not self._core.is_scheduler_paused()
                and core.get_weight_version() == INITIAL_VERSION
                and back.keys() == base.keys()
                and all(torch.equal(back[n], t) for n, t in base.items())
            )
        except Exception:  # noqa: BLE001 - not restorable for certain: the caller starts a new LLM
            return False


#: The LLM of the last engine make_engine made in this process, restored when that engine shut down.
_spare: Any = None


def release_spare() -> None:
    """Shut down the LLM make_engine keeps for the next engine of this process, if it keeps one."""
    global _spare
    llm, _spare = _spare, None
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()


def make_engine(spec: WeightSpec | None = None) -> InProcessVllm:
    """Engine factory for `--weightsync-engine=harness.engines.vllm:make_engine`: real vLLM, in
    process, serving the tiny Llama of harness.engines.tiny_hf_models (built once under
    WEIGHTSYNC_MODEL_CACHE, default a folder in the temp dir). Any path delivers into it through `commit_weights`, i.e.
    through vLLM's own lifecycle. vLLM serves a fixed model: a spec must be a subset of its own.
    Fresh at version 0 either way: a new LLM, or the restored one of the last engine shut down here."""
    global _spare
    llm, _spare = _spare, None
    engine = InProcessVllm(tiny_model_dir(), tempfile.mkdtemp(prefix="weightsync-vllm-engine-"), llm=llm)
    engine.owns_workdir = True
    engine.recyclable = True
    return refuse_foreign_spec(engine, spec)


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
