"""Deliberately broken backends and engines: the conformance suite must fail against each of them.
If one of these ever passes, a check has gone soft."""

from __future__ import annotations

import os

import torch

from harness.engines.reference import ReferenceEngine
from harness.paths.disk import DiskBackend, DiskSender


class SignLosingSender(DiskSender):
    """Adds +0.0 to float tensors before writing: -0.0 becomes 0.0 (and the manifest agrees)."""

    def prepare(self, version, named_tensors):
        damaged = {n: (t + 0.0 if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t)
                   for n, t in named_tensors.items()}
        return super().prepare(version, damaged)


class SignLosingBackend(DiskBackend):
    name = "broken-sign"

    def deploy(self, n_receivers, spec, workdir, engine=None):
        dep = super().deploy(n_receivers, spec, workdir, engine)
        broken = SignLosingSender(dep.sender.root)
        broken._run = dep.sender._run  # noqa: SLF001 - same run directory layout
        dep.sender = broken
        return dep


class LeakySender(DiskSender):
    """Keeps every version directory and one open file per sync: both grow with the number of syncs."""

    def prepare(self, version, named_tensors):
        self.keep_versions = 10**9
        self._leaked = [*getattr(self, "_leaked", []), open(os.devnull)]  # noqa: SIM115 - the leak under test
        return super().prepare(version, named_tensors)


class LeakyBackend(DiskBackend):
    name = "broken-leaky"

    def deploy(self, n_receivers, spec, workdir, engine=None):
        dep = super().deploy(n_receivers, spec, workdir, engine)
        dep.sender.__class__ = LeakySender  # same state, leaky behaviour
        return dep


class StaleCacheEngine(ReferenceEngine):
    """Commits weights but keeps its prefix cache: serves KV computed with the old weights."""

    def commit_weights(self, tensors, version):
        cache = dict(self._prefix_cache)
        super().commit_weights(tensors, version)
        self._prefix_cache.update(cache)


def make_sign_losing_backend():
    return SignLosingBackend()


def make_stale_cache_engine(spec=None):
    return StaleCacheEngine(extra=spec)


def make_leaky_backend():
    return LeakyBackend()
