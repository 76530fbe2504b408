"""The contracts every sync path and engine in weightsync implements.

The shapes follow vLLM's weight-transfer lifecycle so that a backend certified here maps onto vLLM:

    trainer                                   engine (one per receiver rank)
    -------                                   ------------------------------
    Sender.init()  -> init_info          ->   Receiver.init_transfer_engine(init_info)
                                              Receiver.start_weight_update()
    Sender.prepare(version, tensors)
        -> update_info                   ->   Receiver.update_weights(update_info)
    Sender.transmit()        (concurrently with update_weights: the data plane)
                                              Receiver.finish_weight_update(version)  # atomic commit

`update_info` and `init_info` are JSON-able dicts: they are what a control plane (HTTP) carries.
Tensors only ever travel on the data plane of the path.

Engines expose an oracle, `read_weights()`, that reads the live parameters without going through
any sync path; the suites compare it with what the trainer sent.

Why one file: these are the contracts a user implements, read from top to bottom with nothing else in between.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, Self, runtime_checkable

import torch

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")
FinishReason = Literal["length", "stop", "abort"]

JSON = dict[str, Any]


# --------------------------------------------------------------------------------------------- errors
class WeightSyncError(Exception):
    """Base of every error the harness raises on purpose."""


class BackendError(WeightSyncError):
    """A backend name or import path that cannot be resolved to a factory."""


class LifecycleError(WeightSyncError):
    """A lifecycle call made out of order (e.g. update_weights before start_weight_update)."""


class VersionError(WeightSyncError):
    """A version that is not newer than the one the engine serves."""


class UnknownTensorError(WeightSyncError):
    """A tensor name the engine does not have."""


class ManifestMismatch(WeightSyncError):
    """What arrived does not match the manifest or the engine: dtype, shape, size or digest."""


class BaseMismatch(ManifestMismatch):
    """A patch made against another version than the one the engine holds."""


class TransferError(WeightSyncError):
    """The data plane failed: a peer died, timed out, or delivered a short payload."""


class EngineStateError(WeightSyncError):
    """An engine call that its current state forbids (e.g. resume when not paused)."""


class RankFailure(TransferError):
    """A receiver rank died, or was killed by its supervisor for not answering within the timeout."""


class PartialCommitError(TransferError):
    """finish_weight_update failed on some engines after others committed: the engines now serve
    different versions. `versions` lists what each engine serves (None: it could not be asked)."""

    def __init__(self, message: str, versions: list[int | None]):
        super().__init__(message)
        self.versions = versions


# --------------------------------------------------------------------------------------------- requests
@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A token-id request. Sampling is greedy so outputs are comparable across engines."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    #: Top log-probs each TokenEvent should carry besides the chosen token's (OpenAI's `logprobs`):
    #: None or 0 none, N the N most likely tokens. Only engines that `reports_logprobs` honour it.
    logprobs: int | None = None

    def check(self, vocab_size: int) -> None:
        """Raise ValueError, naming the request, unless an engine of this vocabulary can serve it."""
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        bad = [t for t in self.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {self.request_id!r}: token ids {bad[:5]} outside vocab {vocab_size}")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= vocab_size:
            raise ValueError(f"request {self.request_id!r}: logprobs {self.logprobs} outside 0..{vocab_size}")


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One streamed token, stamped with the weight version that produced it."""

    request_id: str
    index: int
    token_id: int | None  # None on the final event of an aborted request that produced nothing more
    weight_version: int
    finish_reason: FinishReason | None = None
    #: The chosen token's log-probability (log_softmax of the logits it was chosen from, float32);
    #: None where the engine does not report it (`Engine.reports_logprobs`) or there is no token.
    logprob: float | None = None
    #: (token id, log-probability) of the request's `logprobs` most likely tokens, most likely first;
    #: None unless the request asked for some and the engine reports them.
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    token_versions: list[int]  # weight version that produced each token
    finish_reason: FinishReason | None

    @property
    def versions_seen(self) -> set[int]:
        return set(self.token_versions)


class RequestStream:
    """A thread-safe stream of TokenEvents for one request; iterate it, or call `result()`."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        #: Prompt tokens the engine served from its prefix cache (vLLM's `num_cached_tokens`), set by
        #: the engine before the first token is pushed; None where it does not say.
        self.num_cached_tokens: int | None = None
        self._events: list[TokenEvent] = []
        self._cond = threading.Condition()
        self._done = False
        self._listeners: list[Callable[[list[TokenEvent]], None]] = []

    # producer side (the engine)
    def push(self, event: TokenEvent) -> None:
        with self._cond:
            if self._done:
                raise EngineStateError(f"request {self.request.request_id!r} already finished")
            self._events.append(event)
            if event.finish_reason is not None:
                self._done = True
            self._cond.notify_all()
            for deliver in self._listeners:
                deliver([event])

    def subscribe(self, deliver: Callable[[list[TokenEvent]], None]) -> None:
        """Call `deliver` with the events so far, then with each new one, in order, until the request
        ends: a consumer that needs no thread of its own (the control server's streams). It runs on
        the producer's thread under the stream's lock, so it must hand off and return (e.g.
        `loop.call_soon_threadsafe`), never block."""
        with self._cond:
            self._listeners.append(deliver)
            if self._events:
                deliver(list(self._events))

    # consumer side
    @property
    def done(self) -> bool:
        with self._cond:
            return self._done

    def __iter__(self) -> Iterator[TokenEvent]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events) and not self._done:
                    self._cond.wait()
                if i >= len(self._events):
                    return
                event = self._events[i]
            i += 1
            yield event

    @property
    def token_count(self) -> int:
        """Tokens produced so far."""
        with self._cond:
            return sum(e.token_id is not None for e in self._events)

    def events_after(self, index: int, timeout: float) -> list[TokenEvent]:
        """Events from `index` on, waiting up to `timeout` for at least one (for remote pumps)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or len(self._events) > index, timeout)
            return self._events[index:]

    def wait_for_tokens(self, n: int, timeout: float) -> bool:
        """Block until n tokens were produced or the request finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._done or sum(e.token_id is not None for e in self._events) >= n, timeout
            )

    def result(self, timeout: float | None = None) -> Completion:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request.request_id!r} did not finish in {timeout}s")
            events = list(self._events)
        tokens = [e for e in events if e.token_id is not None]
        return Completion(
            request_id=self.request.request_id,
            token_ids=[e.token_id for e in tokens],  # type: ignore[misc]
            token_versions=[e.weight_version for e in tokens],
            finish_reason=events[-1].finish_reason if events else None,
        )


# --------------------------------------------------------------------------------------------- capabilities
ALL_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend claims. Suites report NOT_SUPPORTED for anything not claimed."""

    dtypes: frozenset[torch.dtype] = frozenset(ALL_DTYPES)
    delta: bool = False
    ipc: bool = False
    gpu: bool = False
    multi_receiver: bool = False
    max_receivers: int = 1
    pause_modes: frozenset[str] = frozenset(PAUSE_MODES)
    arbitrary_tensors: bool = True  # engine accepts any (name, shape, dtype) spec, not only a fixed model
    interposable: bool = False  # the sender calls `Sender.tap` on every unit of payload (fault injection)
    http_control: bool = (
        False  # the lifecycle goes over HTTP: each handle's receiver has a ControlClient `.client`
    )
    buckets: bool = (
        False  # the data plane moves a version in units of `Backend.bucket_bytes`, set by deploy()
    )
    #: the trainer's side is several processes the harness may signal (`Deployment.trainer_processes()`: a
    #: resharded sync's FSDP ranks), so the trainer-rank fault cells apply
    trainer_ranks: bool = False

    def restricted_by(self, engine: Capabilities) -> Capabilities:
        """What a (backend, engine) pair can do: what both support."""
        return Capabilities(
            dtypes=self.dtypes & engine.dtypes,
            delta=self.delta and engine.delta,
            ipc=self.ipc and engine.ipc,
            gpu=self.gpu and engine.gpu,
            multi_receiver=self.multi_receiver and engine.multi_receiver,
            max_receivers=min(self.max_receivers, engine.max_receivers),
            pause_modes=self.pause_modes & engine.pause_modes,
            arbitrary_tensors=self.arbitrary_tensors and engine.arbitrary_tensors,
            interposable=self.interposable,  # a property of the data plane alone
            http_control=self.http_control,  # a property of the control plane alone
            buckets=self.buckets,  # a property of the data plane alone
            trainer_ranks=self.trainer_ranks,  # a property of the sender alone
        )

    def describe(self) -> JSON:
        return {
            "dtypes": sorted(str(d).removeprefix("torch.") for d in self.dtypes),
            "delta": self.delta,
            "ipc": self.ipc,
            "gpu": self.gpu,
            "multi_receiver": self.multi_receiver,
            "max_receivers": self.max_receivers,
            "pause_modes": sorted(self.pause_modes),
            "arbitrary_tensors": self.arbitrary_tensors,
            "interposable": self.interposable,
            "http_control": self.http_control,
            "buckets": self.buckets,
            "trainer_ranks": self.trainer_ranks,
        }


#: What an engine factory that declares nothing allows: it restricts no backend. An engine factory
#: may carry `factory.capabilities` (a Capabilities) to say what it cannot do (a fixed model, one dtype).
ENGINE_UNRESTRICTED = Capabilities(delta=True, ipc=True, gpu=True, multi_receiver=True, max_receivers=1 << 30)


# --------------------------------------------------------------------------------------------- engine
class InPlaceLoad(abc.ABC):
    """A streaming load into the live parameters, as vLLM's load_weights does: each tensor is written
    where the forward pass reads it as it arrives, so no second copy of the model is held. No forward
    pass runs while the load is open (requests wait), and it ends in exactly one of `commit` (its version
    becomes the engine's, caches invalidated) or `rollback` (the committed version back, bit for bit)."""

    @abc.abstractmethod
    def write(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy these tensors (checkpoint names) into the live parameters. A name the engine lacks or a
        wrong shape or dtype raises before anything of this call is written; the load stays open."""

    @abc.abstractmethod
    def commit(self) -> None: ...

    @abc.abstractmethod
    def rollback(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


WeightSpec = Mapping[str, TensorSpec]


def spec_of(named: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The spec (shape and dtype per name) of a set of tensors, as a deployment is built for."""
    return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in named.items()}


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for an engine's model (`Engine.tokenizer`), what a text prompt needs.
    `decode` takes any ids of the vocabulary (invalid byte sequences become U+FFFD, never an error)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def copy_weights_into(current: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor]) -> None:
    """`out[name].copy_(current[name])` for every name of `out`, refusing a name, shape or dtype that
    differs (copy_ would convert a dtype silently)."""
    for name, dst in out.items():
        src = current.get(name)
        if src is None:
            raise UnknownTensorError(f"the engine has no weight {name!r}")
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise ManifestMismatch(
                f"weight {name!r} is {tuple(src.shape)} {src.dtype} on the engine, "
                f"{tuple(dst.shape)} {dst.dtype} where it is read into"
            )
        dst.copy_(src)


class Engine(abc.ABC):
    """An inference engine that serves token-id requests and holds one committed weight version.

    Optional, for the control plane's text completions (/v1/completions): `tokenizer` (text prompts in,
    text out; None: token ids only, a text prompt is refused) and `reports_logprobs` (each TokenEvent
    carries its `logprob`, and the `top_logprobs` a request asks for; False: `logprobs` is refused)."""

    #: The model's tokenizer (`Tokenizer`), or None when the engine serves token ids only.
    tokenizer: Tokenizer | None = None
    #: TokenEvent.logprob (and top_logprobs when asked) are filled for every token.
    reports_logprobs: bool = False

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The committed version; changes only at a successful commit."""

    @abc.abstractmethod
    def weight_spec(self) -> dict[str, TensorSpec]:
        """Checkpoint names, shapes and dtypes the engine accepts."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; tokens stream as they are produced."""

    def generate(self, requests: Sequence[GenerationRequest], timeout: float = 60.0) -> list[Completion]:
        streams = [self.submit(r) for r in requests]
        return [s.result(timeout) for s in streams]

    def abort_requests(self, request_ids: Sequence[str]) -> int:
        """End these requests now with finish_reason 'abort' (partial output kept); returns how many
        were still running or queued. Engines that cannot abort by id raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot abort requests by id")

    @abc.abstractmethod
    def pause(self, mode: PauseMode = "abort", clear_cache: bool = False) -> None:
        """Stop serving until resume(). "In flight" means every request submitted and not finished,
        whether running or still queued behind the engine's batch (never scheduled):
        abort: each ends now with finish_reason 'abort' and the tokens it produced (none for a queued one);
        wait: return once each finished, all on the committed version;
        keep: freeze each where it is; after resume it continues from there with the version committed
        meanwhile, over the KV cache the old version computed or recomputing it (a preempted request).
        Requests submitted while paused queue and run after resume."""

    @property
    def max_running_requests(self) -> int | None:
        """How many requests the engine runs at once; more wait in its queue (vLLM's max_num_seqs).
        None: unknown. The suites send more than this to exercise the queue."""
        return None

    def model_config(self) -> JSON | None:
        """The Hugging Face config (config.json's contents, `model_type` included) of the model the
        engine computes with, or None when it serves no such model. The suites run the pushed checkpoint
        through a second implementation built from it (transformers) and score what the engine computes,
        not only what it stores: a head derived at load time, a stale cache, a kept request's KV."""
        return None

    @abc.abstractmethod
    def resume(self) -> None: ...

    @property
    @abc.abstractmethod
    def is_paused(self) -> bool: ...

    @abc.abstractmethod
    def read_weights(self) -> dict[str, torch.Tensor]:
        """Oracle: the parameters the forward pass uses, by checkpoint name, copied out (while an
        in-place load is open, those of the committed version)."""

    def read_weights_into(self, out: Mapping[str, torch.Tensor]) -> None:
        """What read_weights returns for the names of `out`, copied into `out`'s tensors (same shapes
        and dtypes; nothing is converted): a receiver that patches the committed weights (delta) reads
        its base into memory it already holds. Engines may copy straight from their live weights; this
        default goes through read_weights."""
        copy_weights_into(self.read_weights(), out)

    def check_update(self, names: Iterable[str], version: int) -> None:
        """Refuse an update before any byte is staged: a version not newer than the committed one,
        or a name the engine lacks. Engines with fused groups also refuse a partial group."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise VersionError(f"version must be an int, got {version!r}")
        if version <= self.weight_version:
            raise VersionError(f"version {version} is not newer than the committed {self.weight_version}")
        spec = self.weight_spec()
        unknown = sorted(n for n in names if n not in spec)
        if unknown:
            raise UnknownTensorError(f"version {version}: unknown tensor(s) {unknown[:5]}")

    @abc.abstractmethod
    def commit_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Atomically install a verified set of tensors as `version` and invalidate caches.
        Called by receivers at finish; no forward pass sees a half-applied set. The engine may keep
        the tensors themselves: the caller hands them over and must not modify them afterwards."""

    #: Receivers stream every verified part of a version into the live weights (begin_in_place_load)
    #: instead of staging the whole version and handing it to commit_weights at finish.
    loads_in_place: bool = False

    def begin_in_place_load(self, version: int) -> InPlaceLoad:
        """Open an in-place load of `version` (refused, as check_update does, unless newer than the
        committed one). Engines that only swap whole versions raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot load in place")

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass


# --------------------------------------------------------------------------------------------- paths
#: The data-plane interposer: called as tap(unit, data, location) on every unit of payload (a bucket,
#: shard or segment: `data` its bytes as a uint8 tensor, `location` a file path or segment name or
#: None) after the digests were computed and before the unit leaves the trainer. It may change bytes
#: in place (corruption) or return a length: the bytes past it never arrive (a cut).
Tap = Callable[[int, torch.Tensor, "str | None"], "int | None"]


def apply_cut(keep: int | None, data: torch.Tensor) -> int | None:
    """What a tap's answer means for a fixed-size unit: bytes past `keep` are lost (zeroed)."""
    if keep is not None and 0 <= keep < data.numel():
        data[keep:].zero_()
        return keep
    return None


class Sender(abc.ABC):
    """Trainer side of a sync path. A backend that claims `interposable` calls `self.tap`, when set,
    on every unit of payload it sends (see Tap)."""

    tap: Tap | None = None

    @abc.abstractmethod
    def init(self) -> JSON:
        """Set up the data plane; returns the init_info each receiver's init_transfer_engine takes."""

    @abc.abstractmethod
    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        """Stage `version` for sending; returns the update_info receivers get in update_weights.

        A sender that can judge the version alone (a name or a shape its model lacks) may refuse it here with
        the error a receiver would raise (UnknownTensorError, ManifestMismatch): no receiver sees the version,
        so their update stays open as it was (the lifecycle state machine accepts either place)."""

    @abc.abstractmethod
    def transmit(self) -> None:
        """Move the prepared bytes on the data plane (runs concurrently with update_weights)."""

    def complete(self, committed: bool) -> None:  # noqa: B027 - optional hook
        """The sync of the prepared version is over: every engine committed it (True) or it was
        abandoned (False). Paths release what prepare() staged; delta advances its base only on True."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """The engines were replaced by fresh ones: forget the versions sent so far."""

    def reset_base(self) -> None:  # noqa: B027 - optional hook
        """The engines may hold different versions (a restarted rank, a partial commit): assume
        nothing about them; the next prepare() sends every tensor whole."""

    def diagnose(self) -> list[str]:
        """After a failed sync, before complete(False): what the sender finds done to its data plane by
        someone else (a segment removed, a directory deleted), each a sentence; push() adds them to the
        error as notes, so the failure says what was damaged instead of a receiver's guess."""
        return []

    def settle(self) -> None:  # noqa: B027 - optional hook
        """Return once background housekeeping (e.g. deleting retired checkpoints) is done; a check
        that counts what a path leaves behind calls it first."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass


class Receiver(abc.ABC):
    """Engine side of a sync path, with vLLM's four-phase lifecycle."""

    @abc.abstractmethod
    def init_transfer_engine(self, init_info: JSON) -> None: ...

    @abc.abstractmethod
    def start_weight_update(self) -> None: ...

    @abc.abstractmethod
    def update_weights(self, update_info: JSON) -> None: ...

    @abc.abstractmethod
    def finish_weight_update(self, version: int) -> None: ...

    @abc.abstractmethod
    def abort_weight_update(self) -> None:
        """Discard whatever was staged (beyond vLLM's lifecycle: what a trainer needs when another
        rank failed); the engine keeps its committed version."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass


# --------------------------------------------------------------------------------------------- backends
@dataclasses.dataclass
class EngineHandle:
    """A receiver paired with the engine it delivers into (local objects, or proxies to a rank)."""

    receiver: Receiver
    engine: Engine


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """A process of a deployment that the harness may signal (kill, stop) to inject a fault."""

    name: str  # how errors name it, e.g. "rank 2"
    pid: int
    log_path: str | None = None


#: The timeout a deployment honours when its backend declares none.
DEFAULT_TIMEOUT_S = 60.0


class Deployment(abc.ABC):
    """One trainer-side Sender wired to N engines by one path; what a backend factory builds.

    What fault injection needs from any backend: `timeout_s` (the declared bound: a data-plane wait
    or a lifecycle call that does not complete in it fails, naming the party), `processes()` (the
    receiver ranks, as processes the harness can signal) and `recover()` (after a failed sync, make
    the next one possible without a redeploy by hand)."""

    sender: Sender
    handles: list[EngineHandle]
    timeout_s: float = DEFAULT_TIMEOUT_S
    needs_recovery: bool = False  # set by push() when a sync failed with anything but a clean refusal

    def processes(self) -> list[RankInfo]:
        """The receiver ranks in the order of `handles` (empty: engines live in the trainer)."""
        return []

    def healthy(self) -> bool:
        """Every rank alive and answering (checked by push() before each sync; cheap)."""
        return True

    def recover(self) -> None:
        """Called by push() before the sync that follows a failed one: restart dead ranks (their
        engines start at version 0), rebuild the data plane, and make the sender assume nothing
        about what the engines hold (delta falls back to a full sync)."""
        self.sender.reset_base()

    @abc.abstractmethod
    def reset(self, spec: WeightSpec | None = None) -> None:
        """Replace every engine by a fresh one at version 0 (optionally with a new weight spec) and
        reset the sender; the transport stays up and the receivers stay initialised."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


DEFAULT_ENGINE = "harness.engines.reference:make_engine"


CEILING_KINDS = ("device-copy", "p2p-copy", "h2d-copy", "nccl", "gloo", "disk", "memcpy")


class Backend(abc.ABC):
    """A sync path under test. A factory named by import path returns one of these."""

    name: str
    capabilities: Capabilities
    #: The unit the data plane moves a version in (bytes; broadcast buckets, ipc segments, disk shards),
    #: None where it has none. A tensor larger than a bucket gets one of its own.
    bucket_bytes: int | None = None
    #: The raw transport that bounds this path, measured beside it by `weightsync bench` and `certify`:
    #: one of CEILING_KINDS ("device-copy": a copy on the same GPU; "p2p-copy": a copy between two GPUs;
    #: "h2d-copy": pinned host memory to the GPU (weights staged in host memory); "nccl" / "gloo": a bare
    #: broadcast of the path's own bucket plan to the same ranks; "disk": file write + fsync, then mapped
    #: by every receiver; "memcpy": a host copy). None: no ceiling, so its rows cannot be gated.
    ceiling: str | None = None
    #: The throughput gate's two floors (harness.throughput_model): the fraction of the verified ceiling's
    #: bandwidth the path must reach, and what one sync may cost beyond its bytes (ms). None: the default
    #: of the declared ceiling kind (harness.bench.DEFAULT_FLOORS), and the report says so.
    bandwidth_floor: float | None = None
    fixed_cost_ms: float | None = None
    #: Why the declared floors are what they are (what was measured, where, when): the report prints it
    #: beside the floor. None where the backend declares none of its own.
    floor_reason: str | None = None
    #: What a path declares for the harness's own tiers and reports, so adding a path touches its own
    #: module and the registry only. `soak`: the fault soak (harness.faults.soak) cycles through it.
    #: `dense_path`: for a delta path, the registry name of the dense path it rides on (what its rows
    #: are compared with). `control_receiver`: its receiver (`pkg.module:Class`) where the control
    #: server's command line can serve it alone, beside an engine, with init_info sent over HTTP.
    soak: bool = False
    dense_path: str | None = None
    control_receiver: str | None = None
    #: Where a path delivers into an engine of its own (the resharded sync's TP engine), why: it refuses
    #: other engine factories, and a suite that needs its own engine (a stalling one) is NOT_SUPPORTED.
    own_engine: str | None = None
    #: Where the harness's benchmark cannot measure the path (its payload of any size, which a backend serving
    #: one model refuses): the import path of the path's own `measure_sync` (harness.bench's signature).
    measure: str | None = None
    #: The most pytest-xdist workers certify runs a suite of this path on (None: as many as the cores
    #: allow): a path whose every deployment holds many processes, each with a CUDA context on one GPU
    #: (the resharded sync's), is slowed, not sped up, by more.
    max_jobs: int | None = None

    def deploy(
        self,
        n_receivers: int,
        spec: WeightSpec | None,
        workdir: str,
        engine: str | None = None,
        bucket_bytes: int | None = None,
    ) -> Deployment:
        """Build a Sender and `n_receivers` engines, each made by the engine factory named `engine`
        (an import path `pkg.module:factory` taking the spec; None: the reference engine) with `spec` (None:
        its default model). A backend that claims `buckets` takes `bucket_bytes` (None: its own
        `bucket_bytes`), so a suite can make any path cross its own boundaries. A backend implements
        `build`, which takes these as one DeployRequest (or overrides this method)."""
        return self.build(DeployRequest(n_receivers, spec, workdir, engine, bucket_bytes))

    def build(self, request: DeployRequest) -> Deployment:
        """The deployment `request` asks for (see `deploy`)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither build(request) nor deploy(...)")


@dataclasses.dataclass(frozen=True)
class DeployRequest:
    """What `Backend.deploy` is asked for, as the one object a backend's `build` takes: `n_receivers`
    engines made by the engine factory named `engine` (None: the reference) with the weight spec `spec`
    (None: its default model), their files under `workdir`; `bucket_bytes`, the data plane's unit, for a
    backend that claims `buckets` (None: its own)."""

    n_receivers: int
    spec: WeightSpec | None
    workdir: str
    engine: str | None = None
    bucket_bytes: int | None = None

    def unit(self, default: int) -> int:
        """The bucket size asked for, else the backend's own `default`."""
        return self.bucket_bytes or default
