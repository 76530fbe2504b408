"""The receivers' staging pool (harness.paths.staging_pool): a buffer comes back only when nothing but
the pool references it, so reuse can never rewrite memory an engine, a view or an array still reads."""

from __future__ import annotations

import gc

import torch

from harness.paths.staging_pool import StagingPool


def test_a_buffer_comes_back_once_every_view_of_it_is_gone():
    pool = StagingPool()
    first = pool.take(1024)
    weights = {"w": first[:512].view(torch.bfloat16), "b": first[512:]}  # what an engine keeps
    first_ptr = first.data_ptr()
    del first
    held = pool.take(1024)
    assert held.data_ptr() != first_ptr, "a buffer whose views an engine still holds was handed out again"
    weights.clear()  # the engine let go (its next commit)
    again = pool.take(1024)
    assert again.data_ptr() == first_ptr, "a buffer nobody references was not reused"
    assert (pool.allocated, pool.reused) == (2, 1), f"allocated {pool.allocated}, reused {pool.reused}"


def test_a_numpy_array_over_a_buffer_keeps_it_out_of_reuse():
    pool = StagingPool()
    buf = pool.take(64)
    array = buf[8:16].numpy()  # shares the memory, holds the tensor
    ptr = buf.data_ptr()
    del buf
    gc.collect()
    assert pool.take(64).data_ptr() != ptr, "memory a numpy array still reads was handed out again"
    del array


def test_sizes_are_matched_exactly():
    pool = StagingPool()
    small = pool.take(100)
    del small
    assert pool.take(200).numel() == 200
    assert pool.reused == 0, "a buffer of another size was reused"


def test_trim_keeps_one_update_worth_of_spares():
    pool = StagingPool()
    for _ in range(3):  # three updates: each takes two buckets, the engine drops the older version
        bufs = [pool.take(1000), pool.take(500)]
        del bufs
        pool.trim()
    assert pool.kept_bytes == 1500, f"kept {pool.kept_bytes} bytes after trims, expected 1500 (one update's)"
    in_use = [pool.take(1000), pool.take(500)]
    pool.trim()
    spare = pool.take(3000)
    del spare
    pool.trim()  # buffers in use are always kept; free ones up to the bytes the last update took
    assert pool.kept_bytes == 4500, pool.kept_bytes
    pool.trim()  # an update that took nothing: free buffers go, buffers in use stay
    assert pool.kept_bytes == 1500, pool.kept_bytes
    del in_use
    pool.trim()
    assert pool.kept_bytes == 0, pool.kept_bytes


def test_a_delta_receiver_and_its_transport_share_one_pool():
    """The transport's receive is called by the delta receiver, never its finish: a pool of its own would
    never be trimmed, and patch payloads change size every sync, so it would grow without bound."""
    from harness.engines.reference import ReferenceEngine
    from harness.paths.delta import DeltaIpcReceiver, DeltaReceiver

    for cls in (DeltaReceiver, DeltaIpcReceiver):
        receiver = cls(ReferenceEngine())
        assert receiver.transport.staging is receiver.staging, (
            f"{cls.__name__}: the transport has a pool of its own"
        )


def test_a_buffer_held_for_long_does_not_stop_reuse_of_the_others():
    """A request that keeps one old tensor alive across syncs: the others of its size still come back."""
    pool = StagingPool()
    pinned = pool.take(256)  # held for the whole test, ahead of the others in the pool's line
    for _ in range(4):  # each update: one buffer of the same size, dropped by the next commit
        buf = pool.take(256)
        del buf
        pool.trim()
    assert pool.allocated <= 3, f"{pool.allocated} buffers allocated for one pinned and one cycling"
    del pinned


def test_spares_kept_are_of_the_sizes_the_last_update_took():
    """A dense deploy stages one 64 MiB bucket, then every sparse update stages the patched tensors one by
    one (8 of 8 MiB): the old bucket, free and first in line, must not use up the spare budget, or every
    update allocates its 64 MiB afresh (measured: 4,100 first-touch faults per sync, 0.5 s on a busy VM)."""
    pool = StagingPool()
    engine = [pool.take(64)]  # the dense deploy
    pool.trim()
    for step in range(4):  # sparse updates: the engine drops the last version at each commit
        engine = [pool.take(8) for _ in range(8)]
        pool.trim()
        assert pool.kept_bytes <= 2 * 64, f"after update {step}: {pool.kept_bytes} bytes kept"
    assert pool.allocated <= 1 + 2 * 8, (
        f"{pool.allocated} buffers allocated over 4 updates of 8 same-size tensors: the spares of the sizes "
        f"the updates take were trimmed, the 64-byte bucket nobody takes was kept"
    )
    del engine
