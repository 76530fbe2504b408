"""The reference engine: the tiny decoder served with continuous batching, a prefix cache and vLLM's
three pause modes. It is the engine every path is certified against when no other is named.

Concurrency model: one scheduler thread runs steps; every step holds `_lock` for its whole duration,
and a commit swaps the live parameter dict under the same lock, so no forward pass ever reads a
half-applied update.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harness.api import (
    Engine,
    EngineStateError,
    GenerationRequest,
    InPlaceLoad,
    ManifestMismatch,
    PauseMode,
    RequestStream,
    TensorSpec,
    TokenEvent,
    UnknownTensorError,
    VersionError,
    WeightSpec,
    copy_weights_into,
)
from harness.devices import normalize
from harness.engines import tiny_lm
from harness.engines.byte_tokenizer import N_BYTES, ByteTokenizer
from harness.engines.tiny_lm import FUSED_GROUPS, KVCache, ModelConfig
from harness.manifest import dtype_name

PREFIX_BLOCK = 4  # prefix-cache granularity in tokens


@dataclasses.dataclass
class _Running:
    stream: RequestStream
    seq: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    generated: int = 0
    cache: KVCache | None = None


class ReferenceEngine(Engine):
    reports_logprobs = True  # every TokenEvent carries its logprob (and top_logprobs when asked)

    def __init__(
        self,
        config: ModelConfig | None = None,
        extra: WeightSpec | None = None,
        seed: int = 0,
        max_batch: int = 8,
        loads_in_place: bool = False,
        device: str | torch.device | None = None,
    ):
        self.config = config or ModelConfig()
        # weights, forward passes, KV and prefix caches all live here; a commit never leaves it
        self.device = torch.device(normalize(device))
        # one token per byte: the tiny decoder's 256 ids are the byte values (none for a smaller vocab)
        self.tokenizer = ByteTokenizer(self.config.vocab_size) if self.config.vocab_size >= N_BYTES else None
        self.max_batch = max_batch
        self.loads_in_place = loads_in_place
        model_spec = tiny_lm.checkpoint_spec(self.config)
        checkpoint = {n: t.to(self.device) for n, t in tiny_lm.init_checkpoint(self.config, seed).items()}
        # Extra tensors ride along as buffers the forward pass does not read (like a model's non-
        # parameter state); they let the suites push any dtype and shape through a path.
        for name, s in (extra or {}).items():
            if name in model_spec:
                if model_spec[name] != s:
                    raise ManifestMismatch(
                        f"extra tensor {name!r} {s} clashes with the model's {model_spec[name]}"
                    )
                continue
            checkpoint[name] = torch.zeros(s.shape, dtype=s.dtype, device=self.device)
        self._spec: dict[str, TensorSpec] = {
            n: TensorSpec(tuple(t.shape), t.dtype) for n, t in checkpoint.items()
        }
        self._live = tiny_lm.fuse(checkpoint)
        self._version = 0
        self._asleep = False  # weights offloaded (vLLM's sleep level 1/2): no forward pass, no commit

        self._lock = threading.RLock()  # held by every step and by commit
        self._cond = threading.Condition(self._lock)
        # Callers (pause, commit, submit, ...) go before the scheduler's next step: Python locks are
        # not fair, and a scheduler that re-takes the lock at once would starve them.
        self._turn = threading.Condition()
        self._callers = 0
        self._waiting: collections.deque[_Running] = collections.deque()
        self._running: list[_Running] = []
        self._seq = itertools.count()
        self._paused = False
        self._loading: _InPlaceLoad | None = None  # an open in-place load: no step runs
        self._drain_below: int | None = None  # pause(wait): only requests with seq < this may run
        self._prefix_cache: dict[tuple[int, ...], KVCache] = {}
        self.prefix_cache_hits = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="reference-engine", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def _priority(self):
        """Hold the step lock, taking it ahead of the scheduler."""
        with self._turn:
            self._callers += 1
        try:
            self._lock.acquire()
        finally:
            with self._turn:
                self._callers -= 1
                self._turn.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ Engine: state
    @property
    def weight_version(self) -> int:
        return self._version

    def weight_spec(self) -> dict[str, TensorSpec]:
        return dict(self._spec)

    @property
    def is_paused(self) -> bool:
        with self._priority():
            return self._paused

    @property
    def max_running_requests(self) -> int:
        return self.max_batch

    def model_config(self) -> dict:
        return tiny_lm.hf_config(self.config)

    def read_weights(self) -> dict[str, torch.Tensor]:
        """The committed version: while an in-place load is open (no forward pass runs), the values a
        rollback would restore stand in for those it has written."""
        with self._priority():
            self._refuse_while_asleep("read_weights")
            weights = {n: t.clone() for n, t in tiny_lm.unfuse(self._live, self.config).items()}
            if self._loading is not None:
                weights.update({n: t.clone() for n, t in self._loading.undo.items()})
            return weights

    def read_weights_into(self, out: Mapping[str, torch.Tensor]) -> None:
        """read_weights' values for the names of `out`, copied from the live tensors (no allocation)."""
        with self._priority():
            self._refuse_while_asleep("read_weights")
            current = tiny_lm.unfuse(self._live, self.config)  # views of the live tensors
            if self._loading is not None:
                current.update(self._loading.undo)
            copy_weights_into(current, out)

    # ------------------------------------------------------------------ Engine: requests
    def submit(self, request: GenerationRequest) -> RequestStream:
        request.check(self.config.vocab_size)
        stream = RequestStream(request)
        with self._priority():
            if self._stopped:
                raise EngineStateError("engine is shut down")
            self._waiting.append(_Running(stream, next(self._seq), list(request.prompt_token_ids)))
            self._cond.notify_all()
        return stream

    def abort_requests(self, request_ids) -> int:
        wanted = set(request_ids)
        with self._priority():
            hit = [r for r in [*self._running, *self._waiting] if r.stream.request.request_id in wanted]
            self._push_abort(hit)
            self._running = [r for r in self._running if r not in hit]
            self._waiting = collections.deque(r for r in self._waiting if r not in hit)
            self._cond.notify_all()
        return len(hit)

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = False) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be abort, wait or keep, got {mode!r}")
        with self._priority():
            if mode == "abort":
                self._paused = True
                self._abort_all()
            elif mode == "wait":
                # Everything submitted before this call is in flight and finishes; later ones queue.
                self._drain_below = next(self._seq)
                self._cond.notify_all()
                self._cond.wait_for(lambda: not self._in_flight_below(self._drain_below))
                self._drain_below = None
                self._paused = True
            else:
                self._paused = True
            if clear_cache:
                self._prefix_cache.clear()
            self._cond.notify_all()

    def resume(self) -> None:
        with self._priority():
            self._refuse_while_asleep("resume")
            self._paused = False
            self._cond.notify_all()

    def reset_prefix_cache(self) -> None:
        with self._priority():
            self._prefix_cache.clear()

    # ------------------------------------------------------------------ Engine: commit
    def _check_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Refuse a name the engine lacks, or a shape or dtype other than the one it holds."""
        unknown = sorted(n for n in tensors if n not in self._spec)
        if unknown:
            raise UnknownTensorError(f"version {version}: unknown tensor(s) {unknown[:5]}")
        for name, t in tensors.items():
            s = self._spec[name]
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise ManifestMismatch(
                    f"version {version}: tensor {name!r} is {tuple(t.shape)} {dtype_name(t.dtype)}, "
                    f"engine holds {s.shape} {dtype_name(s.dtype)}"
                )

    def _refuse_while_loading(self, version: int) -> None:
        """Under the step lock: one version at a time, whole swap or in-place load; none while asleep."""
        self._refuse_while_asleep(f"version {version}")
        if self._loading is not None:
            raise EngineStateError(
                f"version {version}: an in-place load of version {self._loading.version} is open"
            )

    def commit_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.check_update(tensors.keys(), version)
        self._check_tensors(tensors, version)
        # Build the whole new live dict first (copy-on-write), then swap it in under the step lock.
        with self._priority():
            self._refuse_while_loading(version)
            live = self._live
        # ownership passes to the engine (a receiver on another device than the engine's pays a copy here);
        # only what the version names is rebuilt (a fused group arrives whole: check_update), the rest of
        # the live dict is shared with the old one, whose tensors no commit ever writes
        new_live = dict(live)
        new_live.update(tiny_lm.fuse({n: t.detach().to(self.device) for n, t in tensors.items()}))
        with self._priority():
            if version <= self._version:  # re-checked: another commit may have landed meanwhile
                raise VersionError(f"version {version} is not newer than the committed {self._version}")
            self._live = new_live
            self._version = version
            self._prefix_cache.clear()  # cached KV was computed with the old weights
            self._cond.notify_all()

    def begin_in_place_load(self, version: int) -> InPlaceLoad:
        self.check_update((), version)
        with self._priority():
            self._refuse_while_loading(version)
            self._loading = _InPlaceLoad(self, version)
            return self._loading

    def check_update(self, names, version: int) -> None:
        """The base checks, plus: a fused group is sent whole or not at all."""
        names = set(names)
        super().check_update(names, version)
        for parts in FUSED_GROUPS.values():
            for n in names:
                for part in parts:
                    if n.endswith(part):
                        prefix = n[: -len(part)]
                        missing = [prefix + p for p in parts if prefix + p not in names]
                        if missing:
                            raise ManifestMismatch(
                                f"version {version}: {n!r} is part of a fused group; {missing} must be sent with it"
                            )

    # ------------------------------------------------------------------ sleep (vLLM's /sleep, /wake_up)
    def _refuse_while_asleep(self, what: str) -> None:
        if self._asleep:
            raise EngineStateError(f"{what}: the engine is asleep (weights offloaded); call wake_up first")

    def offload_weights(self, path: Path | None) -> None:
        """Free the live weights of a paused engine: into a safetensors file at `path` (vLLM's level 1,
        which wake restores bit for bit), or nowhere (path None: level 2, whose wake gives zeros)."""
        with self._priority():
            if not self._paused:
                raise EngineStateError("offload_weights on a running engine; pause it first")
            if self._asleep:
                return
            if self._loading is not None:
                raise EngineStateError(f"an in-place load of version {self._loading.version} is open")
            if path is not None:
                checkpoint = tiny_lm.unfuse(self._live, self.config)
                save_file({n: t.detach().contiguous().cpu() for n, t in checkpoint.items()}, str(path))
            self._live = {}
            self._prefix_cache.clear()
            self._asleep = True

    def restore_weights(self, path: Path | None) -> None:
        """Load the weights offload_weights freed: from `path`, or zeros of the spec (path None)."""
        with self._priority():
            if not self._asleep:
                return
            if path is not None:
                checkpoint = load_file(str(path), device=str(self.device))
            else:
                checkpoint = {
                    n: torch.zeros(s.shape, dtype=s.dtype, device=self.device) for n, s in self._spec.items()
                }
            self._live = tiny_lm.fuse(checkpoint)
            self._asleep = False

    def resident_weight_bytes(self) -> int:
        """Bytes of weights the engine holds now (0 while asleep at level 1 or 2)."""
        with self._priority():
            return sum(t.numel() * t.element_size() for t in self._live.values())

    def zero_weights(self) -> None:
        """Zero every weight in place, the version unchanged (vLLM's weight_checker action 'reset')."""
        with self._priority():
            self._refuse_while_asleep("zero_weights")
            if self._loading is not None:
                raise EngineStateError(f"an in-place load of version {self._loading.version} is open")
            for t in self._live.values():
                t.zero_()
            self._prefix_cache.clear()

    def shutdown(self) -> None:
        with self._priority():
            self._stopped = True
            self._abort_all()
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ scheduler
    def _push_abort(self, requests) -> None:
        """Ends each of `requests`' streams with an abort at the tokens it has (the lock held)."""
        for r in requests:
            r.stream.push(TokenEvent(r.stream.request.request_id, r.generated, None, self._version, "abort"))

    def _abort_all(self) -> None:
        """Aborts and forgets every running and waiting request (the lock held)."""
        self._push_abort([*self._running, *self._waiting])
        self._running.clear()
        self._waiting.clear()

    def _in_flight_below(self, seq: int | None) -> bool:
        return seq is not None and any(r.seq < seq for r in [*self._running, *self._waiting])

    def _runnable(self) -> bool:
        if self._stopped:
            return True
        if self._loading is not None:
            return False
        if self._drain_below is not None:
            return self._in_flight_below(self._drain_below)
        return not self._paused and bool(self._running or self._waiting)

    def _loop(self) -> None:
        while True:
            with self._turn:
                self._turn.wait_for(lambda: self._callers == 0)
            with self._cond:
                self._cond.wait_for(self._runnable)
                if self._stopped:
                    return
                self._step()
                self._cond.notify_all()

    def _step(self) -> None:
        """One continuous-batching step: admit, then one token for every running request."""
        limit = self._drain_below
        while self._waiting and len(self._running) < self.max_batch:
            if limit is not None and self._waiting[0].seq >= limit:
                break
            self._running.append(self._waiting.popleft())
        for r in list(self._running):
            if limit is not None and r.seq >= limit:
                continue
            if r.cache is None:
                logits = self._prefill(r)
            else:
                logits, r.cache = tiny_lm.forward(self.config, self._live, r.tokens[-1:], r.cache)
            token = int(torch.argmax(logits))
            r.tokens.append(token)
            r.generated += 1
            req = r.stream.request
            finish = None
            if token in req.stop_token_ids:
                finish = "stop"
            elif r.generated >= req.max_tokens:
                finish = "length"
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            top = None
            if req.logprobs:
                values, ids = torch.topk(logprobs, min(req.logprobs, logprobs.numel()))
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
            r.stream.push(
                TokenEvent(
                    req.request_id,
                    r.generated - 1,
                    token,
                    self._version,
                    finish,
                    logprob=float(logprobs[token]),
                    top_logprobs=top,
                )
            )
            if finish:
                self._running.remove(r)

    def _prefill(self, r: _Running) -> torch.Tensor:
        prompt = r.tokens
        cached: KVCache | None = None
        start = 0
        # longest block-aligned cached prefix that still leaves a token to compute logits from
        for n in range((len(prompt) - 1) // PREFIX_BLOCK * PREFIX_BLOCK, 0, -PREFIX_BLOCK):
            hit = self._prefix_cache.get(tuple(prompt[:n]))
            if hit is not None:
                cached, start = hit, n
                self.prefix_cache_hits += 1
                break
        r.stream.num_cached_tokens = start  # read by /v1/completions' usage.prompt_tokens_details
        logits, cache = tiny_lm.forward(self.config, self._live, prompt[start:], cached)
        self._cache_prefix_blocks(prompt, cache)
        r.cache = cache
        return logits

    def _cache_prefix_blocks(self, tokens: list[int], cache: KVCache) -> None:
        """Every full block of `tokens` the cache covers (views, no copies), unless already cached."""
        for n in range(PREFIX_BLOCK, min(len(tokens), cache[0][0].shape[1]) + 1, PREFIX_BLOCK):
            self._prefix_cache.setdefault(tuple(tokens[:n]), [(k[:, :n], v[:, :n]) for k, v in cache])


class _InPlaceLoad(InPlaceLoad):
    """Writes into the live tensors (a fused tensor through its checkpoint-named slice), keeping the
    first old value of each tensor written: rollback copies those back."""

    def __init__(self, engine: ReferenceEngine, version: int):
        self.engine = engine
        self.version = version
        self.undo: dict[str, torch.Tensor] = {}

    def _views(self) -> dict[str, torch.Tensor]:
        e = self.engine
        if e._loading is not self:  # the load is the engine's own room
            raise EngineStateError(f"the in-place load of version {self.version} is closed")
        return tiny_lm.unfuse(e._live, e.config)  # views: a write lands in the live tensor

    def write(self, named_tensors) -> None:
        e = self.engine
        with e._priority():
            views = self._views()
            e._check_tensors(named_tensors, self.version)  # the whole call, before any of it is written
            for name, t in named_tensors.items():
                if name not in self.undo:
                    self.undo[name] = views[name].clone()
                views[name].copy_(t)

    def commit(self) -> None:
        e = self.engine
        with e._priority():
            self._views()
            e._version = self.version
            e._prefix_cache.clear()  # computed with the old weights
            self._close()

    def rollback(self) -> None:
        e = self.engine
        with e._priority():
            views = self._views()
            for name, old in self.undo.items():
                views[name].copy_(old)
            self._close()

    def _close(self) -> None:
        self.undo = {}
        self.engine._loading = None
        self.engine._cond.notify_all()  # the scheduler may step again


def make_engine(spec: WeightSpec | None = None, device: str | None = None) -> ReferenceEngine:
    """Engine factory (the default one): the tiny decoder, plus `spec`'s extra tensors."""
    return ReferenceEngine(extra=spec, device=device)


def make_tied_engine(spec: WeightSpec | None = None, device: str | None = None) -> ReferenceEngine:
    """The same with tied input/output embeddings (no lm_head.weight)."""
    return ReferenceEngine(ModelConfig(tie_word_embeddings=True), extra=spec, device=device)


def make_bf16_engine(spec: WeightSpec | None = None, device: str | None = None) -> ReferenceEngine:
    """The tiny decoder in bfloat16, the dtype RL policies are usually served in."""
    return ReferenceEngine(ModelConfig(dtype=torch.bfloat16), extra=spec, device=device)


def make_in_place_engine(spec: WeightSpec | None = None, device: str | None = None) -> ReferenceEngine:
    """The tiny decoder loading in place, as vLLM does: receivers stream each verified part of a version
    into the live weights and roll back on failure (Engine.begin_in_place_load)."""
    return ReferenceEngine(extra=spec, loads_in_place=True, device=device)
