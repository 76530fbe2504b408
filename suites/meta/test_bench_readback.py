"""A throughput row's `#wrong` reads every engine back through digests computed where the engine lives
(checks.live_digests): a rank answers with 16 bytes a tensor, not the gigabytes a 16 GiB row holds
(copied through the pipe, the read-back took most of a GPU row's time). The digests must still see one
wrong element, and a rank's digest must be the digest of what the oracle reads."""

from __future__ import annotations

import pytest
import torch

from harness import bench, checks
from harness.api import spec_of
from harness.backends.ipc import IpcBackend
from harness.deployment import push
from harness.manifest import digests

pytestmark = [pytest.mark.multiproc, pytest.mark.meta]


class _OneUlpOffBackend(IpcBackend):
    """Moves every byte faithfully, but of weights whose first element of the first tensor is one ulp
    off (the sender's own digests agree with what it sends: only the oracle can tell)."""

    name = "broken-one-ulp"

    def deploy(self, *args, **kwargs):
        dep = super().deploy(*args, **kwargs)
        prepare = dep.sender.prepare

        def off_by_one_ulp(version, named_tensors):
            first = next(iter(named_tensors))
            bad = named_tensors[first].clone()
            bad.view(torch.int16).view(-1)[0] += 1
            return prepare(version, {**named_tensors, first: bad})

        dep.sender.prepare = off_by_one_ulp
        return dep


def test_a_ranks_digests_are_those_of_what_its_oracle_reads(tmp_path):
    weights = bench.payload(1 << 20, 4, seed=3)
    with IpcBackend().deploy(2, spec_of(weights), str(tmp_path)) as dep:
        push(dep, 1, weights)
        for h in dep.handles:
            remote = checks.live_digests(h.engine)  # answered by the rank
            read = h.engine.read_weights()  # copied through the pipe
            local = dict(zip(read, digests(list(read.values())), strict=True))
            assert {n: d[2] for n, d in remote.items()} == local, (remote, local)
            assert checks.digest_mismatches(weights, h.engine) == []


def test_a_row_counts_one_wrong_element_of_a_receiver(tmp_path):
    rows = bench.measure_sync(_OneUlpOffBackend(), [1 << 20], 2, repeats=1, workdir=str(tmp_path))
    (row,) = rows
    assert row.wrong == 2, f"one wrong tensor on each of 2 receivers, the row counted {row.wrong}"
    assert not row.passed, row.to_json()
