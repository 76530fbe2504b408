"""Continuous batching with vLLM's pause modes, for the engines the harness serves itself (the reference
engine in one process, the TP reference engine over M ranks): the request queue, the scheduler's loop
and the lock callers take ahead of it, pause (abort, wait, keep) and resume, abort by id, and each token's
event. An engine computes a step's logits (`_step`, from `_admit()`'s batch to `_emit` per request) and
says what else stops it (`_refuse`, `_stalled`, `_broken`). It checks a version's tensors against the
engine's own spec the same way for both (`_check_tensors`)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Mapping

import torch

from harness.api import (
    Engine,
    EngineStateError,
    GenerationRequest,
    ManifestMismatch,
    PauseMode,
    RequestStream,
    TensorSpec,
    TokenEvent,
    UnknownTensorError,
)
from harness.manifest import dtype_name


@dataclasses.dataclass
class Running:
    """A request the engine has taken: its stream, its place in arrival order, prompt + generated tokens."""

    stream: RequestStream
    seq: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    generated: int = 0


class BatchingEngine(Engine):
    """The scheduling half of an engine; `_start_batching` starts its loop."""

    reports_logprobs = True  # every TokenEvent carries its logprob (and top_logprobs when asked)
    max_batch: int
    _version: int
    _spec: dict[str, TensorSpec]  # the checkpoint the engine holds, by name
    #: what a request becomes when taken (an engine's own Running, with its cache)
    running_class: type[Running] = Running
    #: errors a step may raise that the engine has already answered (its loop goes on)
    answered_step_errors: tuple[type[BaseException], ...] = ()

    def _start_batching(self, max_batch: int, thread_name: str) -> None:
        self.max_batch = max_batch
        self._lock = threading.RLock()  # held by every step and by commit
        self._cond = threading.Condition(self._lock)
        # Callers (pause, commit, submit, ...) go before the scheduler's next step: Python locks are
        # not fair, and a scheduler that re-takes the lock at once would starve them.
        self._turn = threading.Condition()
        self._callers = 0
        self._waiting: collections.deque[Running] = collections.deque()
        self._running: list[Running] = []
        self._seq = itertools.count()
        self._paused = False
        self._drain_below: int | None = None  # pause(wait): only requests with seq < this may run
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
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

    # ------------------------------------------------------------------ what an engine adds
    def _vocab_size(self) -> int:
        raise NotImplementedError

    def _refuse(self, what: str) -> None:
        """Raise EngineStateError if the engine cannot `what` ('submit', 'pause', 'resume') now."""

    def _stalled(self) -> bool:
        """No step may run now (an open in-place load, a failed group)."""
        return False

    def _broken(self) -> bool:
        """The engine can no longer finish what is in flight (pause(wait) stops waiting)."""
        return False

    def _ended(self, r: Running) -> None:
        """`r` left the engine (finished or aborted): what its caches held may go."""

    def _clear_caches(self) -> None:
        """pause(clear_cache=True): the caches a new version must not be served from."""

    def _step(self) -> None:
        raise NotImplementedError

    def _check_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Refuse a name the engine lacks, or a shape or dtype other than the one it holds (`_spec`)."""
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

    # ------------------------------------------------------------------ Engine: requests
    @property
    def is_paused(self) -> bool:
        with self._priority():
            return self._paused

    @property
    def max_running_requests(self) -> int:
        return self.max_batch

    def submit(self, request: GenerationRequest) -> RequestStream:
        request.check(self._vocab_size())
        stream = RequestStream(request)
        with self._priority():
            if self._stopped:
                raise EngineStateError("engine is shut down")
            self._refuse("submit")
            self._waiting.append(self.running_class(stream, next(self._seq), list(request.prompt_token_ids)))
            self._cond.notify_all()
        return stream

    def abort_requests(self, request_ids) -> int:
        wanted = set(request_ids)
        with self._priority():
            hit = [r for r in [*self._running, *self._waiting] if r.stream.request.request_id in wanted]
            self._end_aborted(hit)
            self._running = [r for r in self._running if r not in hit]
            self._waiting = collections.deque(r for r in self._waiting if r not in hit)
            self._cond.notify_all()
        return len(hit)

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = False) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be abort, wait or keep, got {mode!r}")
        with self._priority():
            self._refuse("pause")
            if mode == "abort":
                self._paused = True
                self._abort_all()
            elif mode == "wait":
                # Everything submitted before this call is in flight and finishes; later ones queue.
                self._drain_below = next(self._seq)
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._broken() or not self._in_flight_below(self._drain_below))
                self._drain_below = None
                self._refuse("pause")
                self._paused = True
            else:
                self._paused = True
            if clear_cache:
                self._clear_caches()
            self._cond.notify_all()

    def resume(self) -> None:
        with self._priority():
            self._refuse("resume")
            self._paused = False
            self._cond.notify_all()

    # ------------------------------------------------------------------ scheduler
    def _end_aborted(self, requests) -> None:
        """Ends each of `requests`' streams with an abort at the tokens it has (the lock held)."""
        for r in requests:
            r.stream.push(TokenEvent(r.stream.request.request_id, r.generated, None, self._version, "abort"))
            self._ended(r)

    def _abort_all(self) -> None:
        """Aborts and forgets every running and waiting request (the lock held)."""
        self._end_aborted([*self._running, *self._waiting])
        self._running.clear()
        self._waiting.clear()

    def _in_flight_below(self, seq: int | None) -> bool:
        return seq is not None and any(r.seq < seq for r in [*self._running, *self._waiting])

    def _runnable(self) -> bool:
        if self._stopped:
            return True
        if self._stalled():
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
                with contextlib.suppress(*self.answered_step_errors):
                    self._step()
                self._cond.notify_all()

    def _admit(self) -> list[Running]:
        """Admit waiting requests up to the batch; the requests this step runs (pause(wait): only those
        submitted before it)."""
        limit = self._drain_below
        while self._waiting and len(self._running) < self.max_batch:
            if limit is not None and self._waiting[0].seq >= limit:
                break
            self._running.append(self._waiting.popleft())
        return [r for r in self._running if limit is None or r.seq < limit]

    def _emit(self, r: Running, logits: torch.Tensor) -> None:
        """The greedy token of `logits` for `r`, stamped with the committed version; `r` leaves when done."""
        token = int(torch.argmax(logits))
        r.tokens.append(token)
        r.generated += 1
        req = r.stream.request
        finish = (
            "stop" if token in req.stop_token_ids else "length" if r.generated >= req.max_tokens else None
        )
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
            self._ended(r)
