"""Deliberately broken backends and engines: the conformance suite must fail against each of them.
If one of these ever passes, a check has gone soft."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import safetensors.torch
import torch

from harness.api import RequestStream
from harness.backends.broadcast import BroadcastBackend
from harness.backends.control import ControlBackend, ControlDeployment
from harness.backends.delta import DeltaBackend
from harness.backends.disk import DiskBackend
from harness.backends.ipc import IpcBackend
from harness.engines import tiny_lm
from harness.engines.reference import ReferenceEngine
from harness.engines.reference import make_engine as make_reference_engine
from harness.engines.tiny_lm import ModelConfig
from harness.paths import delta_codec
from harness.paths import disk as disk_path
from harness.paths import ipc as ipc_path
from harness.paths.broadcast import BroadcastSender
from harness.paths.delta import DeltaSender
from harness.paths.disk import DiskSender
from harness.paths.ipc import TOKEN_BYTES, IpcReceiver, IpcSender
from harness.paths.staging_pool import StagingPool


@contextlib.contextmanager
def patched(owner, attr: str, value):
    """`owner.attr` is `value` inside the block and what it was again after it, however the block ends:
    a real module's function swapped for its broken version for one call of the sender."""
    real = getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        setattr(owner, attr, real)


class SwapsSenderClass:
    """Mixin for a broken backend: deploys as its real backend, then swaps the sender's class for
    `broken_sender` (a subclass of the real one), so the sender keeps its state and only the defect
    under test differs."""

    broken_sender: type

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        dep = super().deploy(n_receivers, spec, workdir, engine, bucket_bytes)
        dep.sender.__class__ = self.broken_sender
        return dep


class SignLosingSender(DiskSender):
    """Adds +0.0 to float tensors before writing: -0.0 becomes 0.0 (and the manifest agrees)."""

    def prepare(self, version, named_tensors):
        damaged = {
            n: (t + 0.0 if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t)
            for n, t in named_tensors.items()
        }
        return super().prepare(version, damaged)


class SignLosingBackend(DiskBackend):
    name = "broken-sign"

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        dep = super().deploy(n_receivers, spec, workdir, engine, bucket_bytes)
        broken = SignLosingSender(dep.sender.root)
        broken._run = dep.sender._run
        dep.sender = broken
        return dep


class LeakySender(DiskSender):
    """Keeps every version directory and one open file per sync: both grow with the number of syncs."""

    def prepare(self, version, named_tensors):
        self.keep_versions = 10**9
        self._leaked = [*getattr(self, "_leaked", []), open(os.devnull)]  # noqa: SIM115 - the leak under test
        return super().prepare(version, named_tensors)


class LeakyBackend(SwapsSenderClass, DiskBackend):
    name = "broken-leaky"
    broken_sender = LeakySender


class StaleCacheEngine(ReferenceEngine):
    """Commits weights but keeps its prefix cache: serves KV computed with the old weights."""

    def commit_weights(self, tensors, version):
        cache = dict(self._prefix_cache)
        super().commit_weights(tensors, version)
        self._prefix_cache.update(cache)


class StaleTiedHeadEngine(ReferenceEngine):
    """A tied model whose output head is materialised from the embedding once, at load (as a CPU kernel
    repack does), and never again: it stores every pushed embedding, but computes with the first."""

    def __init__(self, extra=None, device=None):
        super().__init__(ModelConfig(tie_word_embeddings=True), extra=extra, device=device)
        self._live["lm_head.weight"] = self._live[
            "model.embed_tokens.weight"
        ].clone()  # carried by every commit

    def read_weights(self):
        weights = super().read_weights()
        weights.pop("lm_head.weight")  # read back by checkpoint name: the stale head is invisible
        return weights


class DecodeBlockCachingEngine(ReferenceEngine):
    """Caches the prefix blocks a request fills while decoding (as vLLM does), keyed by tokens only: a
    request kept across an update registers blocks whose KV the old weights computed, after the commit
    cleared the cache, and the next request with that prefix is served them."""

    def _step(self):
        super()._step()
        for r in self._running:
            if r.cache is not None:
                self._cache_prefix_blocks(r.tokens, r.cache)


class QueueBlindPauseEngine(ReferenceEngine):
    """pause() reaches only the running batch: requests still queued behind it are neither aborted nor
    waited for; they run after resume, on the new version."""

    def pause(self, mode="abort", clear_cache=False):
        with self._priority():
            queued = list(self._waiting)
            self._waiting.clear()
        super().pause(mode, clear_cache)
        with self._priority():
            self._waiting.extendleft(reversed(queued))


class DeferredSwapEngine(ReferenceEngine):
    """Reports the new version at commit, but computes with the old weights until the requests in flight
    at the commit have finished: a kept request finishes on the old weights, stamped with the new version."""

    _pinned: frozenset = frozenset()

    def commit_weights(self, tensors, version):
        with self._priority():
            old, pinned = self._live, frozenset(id(r) for r in [*self._running, *self._waiting])
        super().commit_weights(tensors, version)
        with self._priority():
            if pinned:
                self._next_live, self._live, self._pinned = self._live, old, pinned

    def read_weights(self):
        with self._priority():
            live = self._next_live if self._pinned else self._live
            return {n: t.clone() for n, t in tiny_lm.unfuse(live, self.config).items()}

    def _step(self):
        super()._step()
        if self._pinned and not any(id(r) in self._pinned for r in [*self._running, *self._waiting]):
            self._live, self._pinned = self._next_live, frozenset()


class FusedBlindRollbackEngine(ReferenceEngine):
    """Loads in place, but its rollback restores only tensors the live model holds under their own name:
    the checkpoint names of fused groups (q/k/v, gate/up) are slices it forgets, so they keep what the
    abandoned load wrote."""

    def __init__(self, extra=None, device=None):
        super().__init__(extra=extra, loads_in_place=True, device=device)

    def begin_in_place_load(self, version):
        load = super().begin_in_place_load(version)
        rollback = load.rollback

        def forgetful_rollback():
            fused = tuple(p for parts in tiny_lm.FUSED_GROUPS.values() for p in parts)
            load.undo = {n: t for n, t in load.undo.items() if not n.endswith(fused)}
            rollback()

        load.rollback = forgetful_rollback
        return load


def make_fused_blind_rollback_engine(spec=None, device=None):
    return FusedBlindRollbackEngine(extra=spec, device=device)


def make_stale_tied_head_engine(spec=None, device=None):
    return StaleTiedHeadEngine(extra=spec, device=device)


def make_decode_block_caching_engine(spec=None, device=None):
    return DecodeBlockCachingEngine(extra=spec, device=device)


def make_queue_blind_pause_engine(spec=None, device=None):
    return QueueBlindPauseEngine(extra=spec, device=device)


def make_deferred_swap_engine(spec=None, device=None):
    return DeferredSwapEngine(extra=spec, device=device)


def make_sign_losing_backend():
    return SignLosingBackend()


def make_stale_cache_engine(spec=None, device=None):
    return StaleCacheEngine(extra=spec, device=device)


def make_leaky_backend():
    return LeakyBackend()


# ------------------------------------------------------------------------------------------ fault suite
class _SwallowingReceiver:
    """Reports every finish as done, even one whose engine failed to commit."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def finish_weight_update(self, version):
        try:
            self.inner.finish_weight_update(version)
        except Exception:  # noqa: BLE001, S110 - the defect under test
            pass


class PartialCommitBackend(DiskBackend):
    """A commit that lands on some engines only, while the trainer is told the sync succeeded."""

    name = "broken-partial-commit"

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        dep = super().deploy(n_receivers, spec, workdir, engine, bucket_bytes)
        for h in dep.handles:
            h.receiver = _SwallowingReceiver(h.receiver)
        return dep


class NoRestartBackend(DiskBackend):
    """A supervisor that never restarts a dead rank: it only reconnects the survivors."""

    name = "broken-no-restart"

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        dep = super().deploy(n_receivers, spec, workdir, engine, bucket_bytes)
        dep._restart_unhealthy = lambda: False
        return dep


class IgnoredTimeoutBackend(DiskBackend):
    """Declares the timeout it is given but waits 16 s for a rank that does not answer.

    16 s, not just over the 8 s bound: on a loaded host the bound grows by what the push's threads waited
    for a CPU (harness.checks.judge_cell), and a 10 s wait passed once beside two xdist workers (2026-12-07).
    Under the push phase's own 18 s budget, so the verdict names the bound the wait broke."""

    name = "broken-ignored-timeout"

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        dep = super().deploy(n_receivers, spec, workdir, engine, bucket_bytes)
        for r in dep.ranks:
            r.timeout = 16.0  # the defect under test: the declared timeout_s stays what it was
        return dep


#: A file whose existence makes every rank started from then on hang in its start (make_hanging_start_engine).
HANG_START_ENV = "WEIGHTSYNC_META_HANG_START"


def make_hanging_start_engine(spec=None, device=None):
    """The reference engine, except that a rank started while the file named by $WEIGHTSYNC_META_HANG_START
    exists never finishes building it: a restart that hangs (a stuck driver, a lock a dead peer held)."""
    trigger = os.environ.get(HANG_START_ENV)
    if trigger and os.path.exists(trigger):
        time.sleep(3600)
    return make_reference_engine(spec, device)


def make_partial_commit_backend():
    return PartialCommitBackend()


def make_no_restart_backend():
    return NoRestartBackend()


def make_ignored_timeout_backend():
    return IgnoredTimeoutBackend()


class _NoRetryControlDeployment(ControlDeployment):
    def _handle_for(self, rank):
        handle = super()._handle_for(rank)
        handle.receiver.client.retries = 0  # the defect under test: a cut connection fails the push
        return handle


class NoRetryControlBackend(ControlBackend):
    """An HTTP control plane whose client never repeats a request, not even one the server de-duplicates."""

    name = "broken-no-retry-control"

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        return _NoRetryControlDeployment(n_receivers, spec, workdir, engine, self.timeout_s)


def make_no_retry_control_backend():
    return NoRetryControlBackend()


# ------------------------------------------------------------------------------------------ delta
class _BroadcastDeltaBackend(SwapsSenderClass, DeltaBackend):
    """A delta path over broadcast whose sender is `broken_sender`, named `broken_name` (a DeltaBackend
    names itself after the dense path it rides on)."""

    broken_name: str

    def __init__(self):
        super().__init__("broadcast")
        self.name = self.broken_name


def _value_diff_changed_indices(old, new):
    return (old != new).nonzero().reshape(-1)  # the defect under test


class _ValueDiffDeltaSender(DeltaSender):
    """Finds what changed by comparing values, not bits: -0.0 == +0.0, so a sign flip is never sent."""

    def prepare(self, version, named_tensors):
        with patched(delta_codec, "changed_indices", _value_diff_changed_indices):
            return super().prepare(version, named_tensors)


class ValueDiffDeltaBackend(_BroadcastDeltaBackend):
    broken_name = "broken-value-diff-delta"
    broken_sender = _ValueDiffDeltaSender


def make_value_diff_delta_backend():
    return ValueDiffDeltaBackend()


class _NeedlessCopySender(BroadcastSender):
    """A broadcast whose trainer stages every tensor through needless copies before sending: bytes
    arrive intact, only slower. The throughput gate must catch it; no correctness test can."""

    def prepare(self, version, named_tensors):
        for _ in range(NEEDLESS_COPIES):
            named_tensors = {n: t.clone() for n, t in named_tensors.items()}
        return super().prepare(version, named_tensors)


NEEDLESS_COPIES = (
    100  # ~0.3 s a push at 64 MiB: past the fixed allowance (80 ms) as well as the bandwidth floor
)


class NeedlessCopyBroadcastBackend(BroadcastBackend):
    """Declares itself `broadcast`: a slower build of the same path, as a vendor's regression would be."""

    sender_cls = _NeedlessCopySender


def make_needless_copy_broadcast_backend():
    return NeedlessCopyBroadcastBackend()


class _TailLosingIpcSender(IpcSender):
    """Copies at most `bucket_bytes` of a bucket into its segment: a tensor larger than a bucket (which
    gets a bucket of its own) arrives with a zeroed tail. No payload of the old suite was that large."""

    def prepare(self, version, named_tensors):
        info = super().prepare(version, named_tensors)
        for shm, ref in zip(self._segments, info["buffers"], strict=False):
            if ref["size"] > self.bucket_bytes:
                shm.buf[TOKEN_BYTES + self.bucket_bytes : TOKEN_BYTES + ref["size"]] = bytes(
                    ref["size"] - self.bucket_bytes
                )
        return info


class TailLosingIpcBackend(SwapsSenderClass, IpcBackend):
    name = "broken-tail-losing-ipc"
    broken_sender = _TailLosingIpcSender


def make_tail_losing_ipc_backend():
    return TailLosingIpcBackend()


class _OneBufferPool(StagingPool):
    """Keeps one staging buffer per size and hands it out on every sync: the naive reuse that forgets
    the engine took the last one as its weights, so the next sync writes into what the engine serves."""

    def take(self, nbytes):
        kept = self.__dict__.setdefault("_one", {})
        if nbytes not in kept:
            kept[nbytes] = torch.empty(nbytes, dtype=torch.uint8)
        return kept[nbytes]


class OneBufferIpcReceiver(IpcReceiver):
    def __init__(self, engine, device=None):
        super().__init__(engine, device)
        self.staging = _OneBufferPool()


class OneBufferIpcBackend(IpcBackend):
    name = "broken-one-buffer-ipc"
    receiver_path = "suites.meta.broken:OneBufferIpcReceiver"


def make_one_buffer_ipc_backend():
    return OneBufferIpcBackend()


class _BaseKeepingDeltaSender(DeltaSender):
    """Keeps its base when told to forget it: after a split (one engine committed, one did not) it
    patches against a base some engine no longer holds, and never falls back to a full sync."""

    def reset_base(self):
        pass  # the defect under test


class BaseKeepingDeltaBackend(_BroadcastDeltaBackend):
    broken_name = "broken-base-keeping-delta"
    broken_sender = _BaseKeepingDeltaSender


def make_base_keeping_delta_backend():
    return BaseKeepingDeltaBackend()


#: NCCL's default collective timeout, which a backend that never passes its own keeps.
NCCL_DEFAULT_TIMEOUT_S = 1800.0


class _HalfHourTimeouts(DiskBackend):
    """Waits 30 minutes for a rank that does not answer, whatever timeout_s it is given."""

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        dep = super().deploy(n_receivers, spec, workdir, engine, bucket_bytes)
        for r in dep.ranks:
            r.timeout = NCCL_DEFAULT_TIMEOUT_S  # the defect under test
        return dep


class DeclaredHalfHourBackend(_HalfHourTimeouts):
    """... and says so: its declared rank RPC timeout is the 30 minutes it waits."""

    name = "broken-declared-half-hour"

    def timeouts(self):
        return {"timeout_s": self.timeout_s, "rank rpc": NCCL_DEFAULT_TIMEOUT_S}


class UndeclaredHalfHourBackend(_HalfHourTimeouts):
    """... and declares the timeout_s it is given: only a deadline of the harness's own bounds it."""

    name = "broken-undeclared-half-hour"


def make_declared_half_hour_backend():
    return DeclaredHalfHourBackend()


def make_undeclared_half_hour_backend():
    return UndeclaredHalfHourBackend()


class _ReadStampedStream(RequestStream):
    """Stamps each event with the engine's version when it is read, not when it was made."""

    def events_after(self, index, timeout):
        now = self._engine.weight_version
        return [dataclasses.replace(e, weight_version=now) for e in super().events_after(index, timeout)]


class ReadStampingEngine(ReferenceEngine):
    """Tokens stamped with the version the engine holds when a client reads them (a server that stamps
    responses as it sends them): right while reads keep up, wrong for a client that reads late."""

    def submit(self, request):
        stream = super().submit(request)
        stream.__class__, stream._engine = _ReadStampedStream, self
        return stream


def make_read_stamping_engine(spec=None, device=None):
    return ReadStampingEngine(extra=spec, device=device)


class OneReceiverOnlyBackend(IpcBackend):
    """Claims several receivers; deploys one, and fails with two (a port both ranks bind)."""

    name = "broken-one-receiver-only"

    def deploy(self, n_receivers, spec, workdir, engine=None, bucket_bytes=None):
        if n_receivers > 1:
            raise OSError(98, "Address already in use: the second rank binds the first one's port")
        return super().deploy(n_receivers, spec, workdir, engine, bucket_bytes)


def make_one_receiver_only_backend():
    return OneReceiverOnlyBackend()


def _publish_first_write_checkpoint(root, manifest, named_tensors, attempt=0, tap=None):
    """Writes the manifest first, into the final directory, then the shards: no temporary directory,
    no rename. A writer killed part-way leaves a version that looks published and is not whole."""
    final = disk_path.version_dir(root, manifest.version, attempt)
    final.mkdir(parents=True)
    (final / disk_path.MANIFEST_FILE).write_text(manifest.dumps())
    for bucket in range(len(manifest.bucket_sizes)):
        shard = {
            e.name: named_tensors[e.name].detach().contiguous().clone()
            for e in manifest.bucket_entries(bucket)
        }
        safetensors.torch.save_file(shard, str(final / disk_path.shard_name(bucket)))
    return final


class _PublishFirstSender(DiskSender):
    def prepare(self, version, named_tensors):
        with patched(disk_path, "write_checkpoint", _publish_first_write_checkpoint):
            return super().prepare(version, named_tensors)


class PublishFirstDiskBackend(SwapsSenderClass, DiskBackend):
    name = "broken-publish-first"
    broken_sender = _PublishFirstSender


def make_publish_first_disk_backend():
    return PublishFirstDiskBackend()


class _DescriptorKeyedIpcSender(IpcSender):
    """Keeps a segment while its own descriptor says the size fits, never asking whether the name still
    leads to it (weightsync's ipc path until 2026-12-03): once another process removed or replaced the
    file, every later push packs into memory no receiver can open."""

    def _fit_segments(self, sizes):
        with patched(ipc_path, "_damage", lambda shm: None):
            super()._fit_segments(sizes)


class DescriptorKeyedIpcBackend(SwapsSenderClass, IpcBackend):
    name = "broken-descriptor-keyed-ipc"
    broken_sender = _DescriptorKeyedIpcSender


def make_descriptor_keyed_ipc_backend():
    return DescriptorKeyedIpcBackend()


class _LastCheckpointTrustingSender(DiskSender):
    """Lists its last published version before writing the next (to link the shards that did not
    change): once a retention cleaner removed that directory, every later push fails."""

    def prepare(self, version, named_tensors):
        if self._written:
            self.unchanged_candidates = sorted(os.listdir(self._written[-1]))
        return super().prepare(version, named_tensors)


class LastCheckpointTrustingDiskBackend(SwapsSenderClass, DiskBackend):
    name = "broken-last-checkpoint-trusting"
    broken_sender = _LastCheckpointTrustingSender


def make_last_checkpoint_trusting_disk_backend():
    return LastCheckpointTrustingDiskBackend()
