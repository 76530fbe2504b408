"""The one driver that pushes a version through a deployment, as a trainer does on every step.

A failed push leaves every engine on the version it had (or, if finish failed part-way, raises
PartialCommitError naming what each engine serves) and marks the deployment for recovery: the next
push first calls `deployment.recover()` (dead ranks restarted, data plane rebuilt, delta base
forgotten), so a trainer never has to redeploy by hand.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import weakref
from collections.abc import Callable, Mapping

import torch

from harness.api import (
    JSON,
    Deployment,
    EngineHandle,
    LifecycleError,
    ManifestMismatch,
    PartialCommitError,
    RankFailure,
    TransferError,
    UnknownTensorError,
    VersionError,
    WeightSyncError,
)

#: Errors that say the engines refused what was sent, with every party alive and the data plane drained:
#: nothing to rebuild afterwards.
REFUSALS = (ManifestMismatch, VersionError, LifecycleError, UnknownTensorError)


def deliver(
    deployment: Deployment,
    version: int,
    named_tensors: Mapping[str, torch.Tensor],
    timeout: float | None = None,
    clock: Clock | None = None,
) -> JSON:
    """prepare(), then the data plane: transmit on the sender while every receiver runs
    update_weights. Once every party has returned (or `timeout`, default twice the deployment's,
    passed) raises the most telling error: a transfer failure (it names the rank) before a refusal.
    Returns the update_info that was delivered."""
    clock = clock or Clock(None)
    update_info = deployment.sender.prepare(version, named_tensors)
    clock.lap("prepare")
    del named_tensors  # a failed transfer's traceback must not keep the version's tensors alive
    return transfer(deployment, version, update_info, timeout, clock)


def transfer(
    deployment: Deployment,
    version: int,
    update_info: JSON,
    timeout: float | None = None,
    clock: Clock | None = None,
) -> JSON:
    """deliver()'s data plane for an update the sender has prepared: transmit while every receiver runs
    update_weights with `update_info`. A caller that must tell a refusal by the sender (in prepare, before any
    receiver saw the version) from one by the receivers calls prepare itself, then this."""
    timeout = 2 * deployment.timeout_s if timeout is None else timeout
    handles = deployment.handles
    clock = clock or Clock(None)
    # a receiver in a rank process is sent its call from here, its reply read below (no thread hand-off);
    # the sender and any other receiver run on the delivery threads, all at once
    sent = []
    for h in handles:
        try:
            sent.append(_begin(h.receiver, "update_weights", update_info))
        except Exception as exc:  # noqa: BLE001 - a rank that cannot be sent it fails as on a thread
            sent.append(_Failed(exc))
    pool = _delivery_pool(deployment, len(handles) + 1)
    futures: list = [pool.submit(deployment.sender.transmit)]
    futures += [
        pool.submit(h.receiver.update_weights, update_info) if p is None else p
        for h, p in zip(handles, sent, strict=True)
    ]
    end = time.monotonic() + timeout
    outcomes: list[BaseException | None] = [None] * len(futures)
    for i, f in enumerate(futures):
        if isinstance(f, cf.Future):
            continue
        if not f.wait(max(end - time.monotonic(), 0.0)):
            # not answered in time: a delivery thread waits on for it, to its rank's deadline (then the
            # rank is killed), and the transfer fails below naming it, as a receiver stuck on a thread
            futures[i] = pool.submit(f.result)
            continue
        try:
            f.result()
        except Exception as exc:  # noqa: BLE001 - ranked with the others below
            outcomes[i] = exc
    threaded = [f for f in futures if isinstance(f, cf.Future)]
    _, pending = cf.wait(threaded, timeout=max(end - time.monotonic(), 0.0))
    if pending:
        _drop_delivery_pool(deployment)  # a stuck party must not hang the trainer; the error says who
        who = ["the sender" if futures.index(f) == 0 else f"receiver {futures.index(f) - 1}" for f in pending]
        raise TransferError(
            f"delivery of version {version}: {', '.join(who)} still running after {timeout:g}s"
        )
    for i, f in enumerate(futures):
        if isinstance(f, cf.Future):
            outcomes[i] = f.exception()
    errors = [(i, exc) for i, exc in enumerate(outcomes) if exc is not None]
    if errors:
        primary = _most_telling(errors)
        # the traceback will hold this frame: drop what would make a cycle through the futures,
        # or every failed sync keeps its tensors alive until a full garbage collection
        del futures, errors, outcomes, threaded
        raise primary
    clock.lap("transfer")
    return update_info


class _Failed:
    """A call that failed to be sent: answered at once with its error."""

    def __init__(self, error: Exception):
        self.error = error

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def result(self):
        raise self.error


def _begin(receiver, method: str, *args):
    """`method` sent to a receiver that can take it without waiting for its reply (a rank's pipe proxy:
    PipeReceiver.begin): its pending reply; None for the others (called on a thread instead)."""
    begin = getattr(receiver, "begin", None)
    return begin(method, *args) if begin is not None else None


#: Each deployment's delivery threads, kept across pushes: starting N+1 threads per push cost more than
#: a same-GPU copy of 1 GiB (a 1 MiB ipc push on the 2-core CPU host: transfer 4.6 -> 1.2 ms median, 2026-12-03). A pool whose party
#: got stuck is dropped (its stuck thread with it) and the next push starts a fresh one; a deployment
#: that is collected takes its pool along (the idle workers then exit).
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _delivery_pool(deployment: Deployment, workers: int) -> cf.ThreadPoolExecutor:
    pool = _POOLS.get(deployment)
    if pool is None or pool._max_workers < workers:
        if pool is not None:
            pool.shutdown(wait=False)
        pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deliver")
        _POOLS[deployment] = pool
    return pool


def _drop_delivery_pool(deployment: Deployment) -> None:
    pool = _POOLS.pop(deployment, None)
    if pool is not None:
        pool.shutdown(wait=False)


def _most_telling(errors: list[tuple[int, BaseException]]) -> BaseException:
    """The trainer's own exception (the root cause), else a rank that died or hung (named), else
    another transfer failure, else the first refusal; the others are attached as notes."""

    def rank(item):
        i, exc = item
        if i == 0 and not isinstance(exc, WeightSyncError):
            return (0, i)
        return (1 if isinstance(exc, RankFailure) else 2 if isinstance(exc, TransferError) else 3, i)

    errors = sorted(errors, key=rank)
    primary = errors[0][1]
    for i, exc in errors[1:]:
        primary.add_note(
            f"also, {'the sender' if i == 0 else f'receiver {i - 1}'}: {type(exc).__name__}: {exc}"
        )
    return primary


def push(
    deployment: Deployment,
    version: int,
    named_tensors: Mapping[str, torch.Tensor],
    timeout: float | None = None,
    timings: dict[str, float] | None = None,
    on_lap: Callable[[str], None] | None = None,
) -> None:
    """The full lifecycle, as a trainer drives it: recover from an earlier failure if needed, start on
    every engine, deliver, finish(version) everywhere. If any party fails, every receiver that started
    discards the update and the error is re-raised; nothing reports success while engines differ.
    `timings`, when given, receives the wall time of each step: start, prepare, transfer, finish."""
    if deployment.needs_recovery or not deployment.healthy():
        deployment.recover()
        deployment.needs_recovery = False
    clock = Clock(timings, on_lap)
    started: list[EngineHandle] = []
    try:
        try:
            # every rank starts while the trainer prepares: a rank's start is in flight meanwhile, and
            # nothing is delivered before every engine has started
            update_info = _start_and_prepare(deployment, version, named_tensors, started, clock)
        except _DiedAtStart:  # a rank died since the health check; nothing was sent yet: recover once
            _abort_all(started)
            started.clear()
            deployment.sender.complete(False)  # its prepared version is never delivered
            deployment.recover()
            _start_all(deployment, started)
            clock.lap("start")
            update_info = deployment.sender.prepare(version, named_tensors)
            clock.lap("prepare")
        del named_tensors  # a failed transfer's traceback must not keep the version's tensors alive
        transfer(deployment, version, update_info, timeout, clock)
    except BaseException as exc:
        # No engine may commit a version another engine refused: discard everywhere.
        _abort_all(started)
        _add_diagnosis(exc, deployment.sender)
        deployment.sender.complete(False)
        deployment.needs_recovery = not isinstance(exc, REFUSALS)
        raise
    for i, h in enumerate(deployment.handles):
        try:
            h.receiver.finish_weight_update(version)
        except BaseException as exc:
            _abort_all(deployment.handles[i + 1 :])
            deployment.sender.complete(False)
            deployment.needs_recovery = True
            if i == 0:  # nothing committed anywhere
                raise
            versions = [_version_of(h) for h in deployment.handles]
            ranks = deployment.processes()
            who = f"engine {i} ({ranks[i].name})" if len(ranks) > i else f"engine {i}"
            partial = (
                f"finish_weight_update({version}) failed on {who} after engine(s) {list(range(i))} committed; "
                f"engines now serve versions {versions} (the next push converges them)"
            )
            if not isinstance(exc, Exception):  # a stop (SIGINT, SIGTERM) stays a stop: its exit status
                exc.add_note(partial)
                raise
            raise PartialCommitError(f"{partial}: {type(exc).__name__}: {exc}", versions) from exc
    deployment.sender.complete(True)
    clock.lap("finish")


def _add_diagnosis(exc: BaseException, sender) -> None:
    """What the sender finds done to its data plane, as notes of the error (shown with it)."""
    try:
        found = sender.diagnose() if hasattr(sender, "diagnose") else []
    except Exception as why:  # noqa: BLE001 - a diagnosis must never hide the failure it explains
        found = [f"(the sender's diagnosis failed: {type(why).__name__}: {why})"]
    for what in found:
        exc.add_note(f"trainer: {what}")


class Clock:
    """Laps of one push, written into `into` (nothing when it is None); `on_lap(name)` after each."""

    def __init__(self, into: dict[str, float] | None, on_lap: Callable[[str], None] | None = None):
        self.into = into
        self.on_lap = on_lap
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.into is not None:
            now = time.perf_counter()
            self.into[name] = self.into.get(name, 0.0) + now - self.t
            if self.on_lap is not None:
                self.on_lap(name)
            self.t = time.perf_counter()


def _start_and_prepare(
    deployment: Deployment,
    version: int,
    named_tensors: Mapping[str, torch.Tensor],
    started: list[EngineHandle],
    clock: Clock,
) -> JSON:
    """start_weight_update on every engine, the sender's prepare while the ranks start (their replies read
    after it: every one, whatever prepare did); `started` gets each engine that started. A start's failure
    is raised before prepare's: an engine that cannot start is what the push reports."""
    sent = []
    for h in deployment.handles:
        try:
            pending = _begin(h.receiver, "start_weight_update")
            if pending is None:  # an engine the driver calls in turn (in this process, over HTTP)
                h.receiver.start_weight_update()
                started.append(h)
            else:
                sent.append((h, pending))
        except RankFailure as exc:
            _collect_starts(sent, started)  # raises an earlier engine's failure first, as in turn
            raise _DiedAtStart() from exc
        except BaseException:
            _collect_starts(sent, started)
            raise
    clock.lap("start")
    try:
        update_info = deployment.sender.prepare(version, named_tensors)
    except BaseException:
        _collect_starts(sent, started)  # raises a start's failure, else prepare's goes on
        raise
    clock.lap("prepare")
    _collect_starts(sent, started)
    clock.lap("start")
    return update_info


def _collect_starts(sent: list, started: list[EngineHandle]) -> None:
    """Read every start's reply; `started` gets those that started; the first failure is raised (a rank
    that died: _DiedAtStart)."""
    failure: BaseException | None = None
    for h, pending in sent:
        try:
            pending.result()
            started.append(h)
        except Exception as exc:  # noqa: BLE001 - the others are read first
            failure = failure or exc
    if isinstance(failure, RankFailure):
        raise _DiedAtStart() from failure
    if failure is not None:
        raise failure


class _DiedAtStart(Exception):
    """A rank died between the health check and its start (push recovers once; never seen outside)."""


def _start_all(deployment: Deployment, started: list[EngineHandle]) -> None:
    for h in deployment.handles:
        h.receiver.start_weight_update()
        started.append(h)


def _version_of(handle: EngineHandle) -> int | None:
    try:
        return handle.engine.weight_version
    except WeightSyncError:  # a dead rank cannot say
        return None


def _abort_all(handles) -> None:
    """Every receiver discards what it staged, all at once (a rank that cannot answer costs one wait)."""

    def abort(h) -> None:
        try:
            h.receiver.abort_weight_update()
        except WeightSyncError:  # a dead rank cannot abort; the original error is what matters
            pass

    if handles:
        with cf.ThreadPoolExecutor(max_workers=len(handles), thread_name_prefix="abort") as pool:
            list(pool.map(abort, handles))
