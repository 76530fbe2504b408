"""The reference engine: the tiny decoder served with continuous batching, a prefix cache and vLLM's
three pause modes. It is the engine every path is certified against when no other is named.

Concurrency model: one scheduler thread runs steps; every step holds `_lock` for its whole duration,
and a commit swaps the live parameter dict under the same lock, so no forward pass ever reads a
half-applied update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harness.api import (
    EngineStateError,
    InPlaceLoad,
    ManifestMismatch,
    TensorSpec,
    VersionError,
    WeightSpec,
    copy_weights_into,
)
from harness.devices import normalize
from harness.engines import tiny_lm
from harness.engines.batching import BatchingEngine, Running
from harness.engines.byte_tokenizer import N_BYTES, ByteTokenizer
from harness.engines.tiny_lm import FUSED_GROUPS, KVCache, ModelConfig

PREFIX_BLOCK = 4  # prefix-cache granularity in tokens


@dataclasses.dataclass
class _Running(Running):
    cache: KVCache | None = None


class ReferenceEngine(BatchingEngine):
    running_class = _Running

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

        self._loading: _InPlaceLoad | None = None  # an open in-place load: no step runs
        self._prefix_cache: dict[tuple[int, ...], KVCache] = {}
        self.prefix_cache_hits = 0
        self._start_batching(max_batch, "reference-engine")

    # ------------------------------------------------------------------ Engine: state
    @property
    def weight_version(self) -> int:
        return self._version

    def weight_spec(self) -> dict[str, TensorSpec]:
        return dict(self._spec)

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

    # ------------------------------------------------------------------ Engine: requests (BatchingEngine)
    def _vocab_size(self) -> int:
        return self.config.vocab_size

    def _refuse(self, what: str) -> None:
        if what == "resume":
            self._refuse_while_asleep("resume")

    def _stalled(self) -> bool:
        return self._loading is not None

    def _clear_caches(self) -> None:
        self._prefix_cache.clear()

    def reset_prefix_cache(self) -> None:
        with self._priority():
            self._prefix_cache.clear()

    # ------------------------------------------------------------------ Engine: commit
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
    def _step(self) -> None:
        """One continuous-batching step: admit, then one token for every running request."""
        for r in self._admit():
            if r.cache is None:
                logits = self._prefill(r)
            else:
                logits, r.cache = tiny_lm.forward(self.config, self._live, r.tokens[-1:], r.cache)
            self._emit(r, logits)

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
