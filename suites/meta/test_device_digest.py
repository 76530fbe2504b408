"""The device digest (harness.device_digest, ws64x2) is a check the whole harness leans on: it must
catch any single flipped bit, any swapped pair of elements and a tensor delivered from the wrong place in
its bucket plan. These properties run the torch-ops reference on the CPU; where a GPU is present the
Triton kernel must give the same bits as the reference (the GPU run also checks it: harness.gpu_check)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import device_digest as dd
from harness.api import ManifestMismatch
from harness.manifest import Manifest, as_bytes, digests, from_bytes

DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64]


def _digest(raw: torch.Tensor) -> str:
    return dd.device_digests([raw])[0]


@st.composite
def payloads(draw, min_bytes=1):
    data = draw(st.binary(min_size=min_bytes, max_size=4096))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@settings(max_examples=300)
@given(raw=payloads(), where=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_single_flipped_bit_changes_the_digest(raw, where, bit):
    flipped = raw.clone()
    flipped[where % raw.numel()] ^= 1 << bit
    before, after = _digest(raw), _digest(flipped)
    assert before != after, f"bit {bit} of byte {where % raw.numel()} of {raw.numel()} flipped: both {before}"


@settings(max_examples=300)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(2, 1500), data=st.data())
def test_any_swapped_pair_of_elements_changes_the_digest(dtype, n, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    t = torch.randint(
        0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen
    )
    typed = t.view(dtype)
    i = data.draw(st.integers(0, n - 1), label="i")
    j = data.draw(st.integers(0, n - 1).filter(lambda j: j != i), label="j")
    a, b = as_bytes(typed[i : i + 1]).clone(), as_bytes(typed[j : j + 1]).clone()
    if torch.equal(a, b):
        return  # equal elements: the swap changes nothing
    swapped = typed.clone()
    swapped[i], swapped[j] = typed[j].clone(), typed[i].clone()
    assert _digest(as_bytes(typed)) != _digest(as_bytes(swapped)), (
        f"{dtype} elements {i} and {j} of {n} swapped"
    )


@settings(max_examples=60)
@given(sizes=st.lists(st.integers(1, 300), min_size=2, max_size=6), data=st.data())
def test_a_tensor_delivered_from_the_wrong_place_in_the_bucket_plan_is_refused(sizes, data):
    gen = torch.Generator().manual_seed(len(sizes))
    shape = (data.draw(st.integers(1, 64), label="elements"),)
    tensors = {f"t{k}": torch.randn(shape, generator=gen).to(torch.bfloat16) for k in range(len(sizes))}
    manifest = Manifest.build(
        1,
        tensors,
        bucket_bytes=data.draw(st.integers(64, 512), label="bucket_bytes"),
        digest_algorithm="ws64x2",
    )
    buckets = [manifest.pack_bucket(b, tensors) for b in range(len(manifest.bucket_sizes))]
    victim, source = data.draw(st.permutations(manifest.entries), label="pair")[:2]
    received = {
        e.name: from_bytes(buckets[e.bucket][e.offset : e.offset + e.nbytes], e.shape, e.torch_dtype)
        for e in manifest.entries
    }
    received[victim.name] = from_bytes(
        buckets[source.bucket][source.offset : source.offset + source.nbytes],
        victim.shape,
        victim.torch_dtype,
    )  # bytes of another tensor, another place
    if torch.equal(as_bytes(tensors[victim.name]), as_bytes(tensors[source.name])):
        return
    with pytest.raises(ManifestMismatch, match=victim.name):
        manifest.verify_all(received)
    assert manifest.wrong(received) == [victim.name]


@given(raw=payloads(), chunk=st.integers(1, 64))
def test_the_sum_does_not_depend_on_how_the_work_is_split(raw, chunk):
    whole = _digest(raw)
    saved = dd._CHUNK_WORDS
    dd._CHUNK_WORDS = chunk  # the reference adds chunk by chunk, the kernel block by block in any order
    try:
        assert _digest(raw) == whole
    finally:
        dd._CHUNK_WORDS = saved


def test_trailing_zero_bytes_change_the_digest():
    raw = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    assert _digest(raw) != _digest(torch.cat([raw, torch.zeros(1, dtype=torch.uint8)]))


def test_host_tensors_keep_xxh3_and_forcing_ws64x2_works_anywhere():
    t = torch.arange(10, dtype=torch.float32)
    assert not dd.is_device_digest(digests([t])[0])
    assert digests([t], "ws64x2")[0] == dd.reference_digest(as_bytes(t))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU run: .ci/gpu-run.sh)")
def test_the_kernel_gives_the_references_bits():
    assert dd.kernel_status().startswith("triton"), dd.kernel_status()
    gen = torch.Generator().manual_seed(1)
    for n in (1, 3, 4, 4097, (1 << 22) + 13):
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        assert dd.device_digests([raw.cuda()])[0] == dd.reference_digest(raw), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU run: .ci/gpu-run.sh)")
def test_one_launch_for_many_tensors_gives_each_tensors_digest():
    assert "one launch for many tensors" in dd.kernel_status(), dd.kernel_status()
    gen = torch.Generator().manual_seed(2)
    raws = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (7, 4096, 1 << 21, 3, 99_999)
    ]
    assert dd.device_digests([r.cuda() for r in raws]) == [dd.reference_digest(r) for r in raws]


def test_separate_tensors_become_segments_of_one_address_range_only_when_aligned():
    """The one-launch plan for a sender's tensors: each segment's offset from the lowest tensor lands on
    that tensor's first word, and a tensor off a 16-byte boundary sends the list elsewhere."""
    raws = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (64, 4096, 100_000, 16)]
    words = [dd._words(r) for r in raws]
    base, segments = dd._as_segments(words)
    assert base.data_ptr() == min(w.data_ptr() for w in words)
    assert [base.data_ptr() + 4 * start for start, _ in segments] == [w.data_ptr() for w in words]
    assert [n for _, n in segments] == [w.numel() for w in words]
    host = torch.zeros(4096, dtype=torch.uint8)
    assert dd._as_segments([dd._words(host[4:68]), *words]) is None  # 4 bytes past an aligned start


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU run: .ci/gpu-run.sh)")
def test_tensors_on_and_off_16_byte_boundaries_give_the_references_bits():
    """Aligned tensors go through the (segment, chunk) grid as one address range; a view that starts
    off a 16-byte boundary sends the whole list to the address-table kernel. Same bits either way."""
    gen = torch.Generator().manual_seed(7)
    host = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen)
    gpu = host.cuda()
    aligned = [
        gpu[: 1 << 20],
        gpu[1 << 20 : (2 << 20) + 12],
        torch.randint(0, 256, (99_999,)).to(torch.uint8).cuda(),
    ]
    assert dd._as_segments([dd._words(r) for r in aligned]) is not None
    offset = [gpu[4 : (1 << 20) + 4], *aligned]
    assert dd._as_segments([dd._words(r) for r in offset]) is None
    for raws in (aligned, offset):
        assert dd.device_digests(raws) == [dd.reference_digest(r.cpu()) for r in raws]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU run: .ci/gpu-run.sh)")
def test_copy_and_digest_copies_every_byte_and_gives_the_references_bits():
    assert dd.copy_kernel_available(), dd._status
    gen = torch.Generator().manual_seed(3)
    raws = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (7, 4096, 1 << 21, 3, 99_999)
    ]
    copies, sums = dd.copy_and_digest([r.cuda() for r in raws])
    assert sums == [dd.reference_digest(r) for r in raws]
    assert all(torch.equal(c.cpu(), r) for c, r in zip(copies, raws))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU run: .ci/gpu-run.sh)")
def test_a_flipped_bit_in_a_gpu_bucket_is_caught_while_unpacking():
    gen = torch.Generator(device="cuda").manual_seed(4)
    tensors = {
        f"t{k}": torch.randn(1000 + k, generator=gen, device="cuda").to(torch.bfloat16) for k in range(5)
    }
    manifest = Manifest.build(1, tensors, bucket_bytes=4096)
    assert all(dd.is_device_digest(e.digest) for e in manifest.entries)
    bucket = manifest.pack_bucket(1, tensors, device="cuda")
    victim = manifest.bucket_entries(1)[0]
    bucket[victim.offset + 17] ^= 8
    verified: set[str] = set()
    with pytest.raises(ManifestMismatch, match=victim.name):
        manifest.unpack_bucket(1, bucket, verified=verified)
    assert not verified


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU run: .ci/gpu-run.sh)")
def test_a_whole_bucket_is_copied_and_each_tensor_digested_in_one_pass():
    gen = torch.Generator(device="cuda").manual_seed(6)
    tensors = {
        f"t{k}": torch.randn(2000 + 2 * k, generator=gen, device="cuda").to(torch.bfloat16) for k in range(6)
    }
    manifest = Manifest.build(1, tensors, bucket_bytes=1 << 20)
    bucket = manifest.pack_bucket(0, tensors, device="cuda")
    whole = dd.copy_and_digest_bucket(bucket, [(e.offset, e.nbytes) for e in manifest.entries])
    assert whole is not None, dd._status
    copy, sums = whole
    assert sums == [e.digest for e in manifest.entries]
    verified: set[str] = set()
    got = manifest.unpack_bucket(0, bucket, verified=verified)
    assert verified == set(tensors) and manifest.wrong(got) == []


def test_the_swap_property_bites_a_mix_that_ignores_position(monkeypatch):
    """The swapped-pair property is not vacuous: with the index taken out of the mix, a swap goes unseen."""
    raw = torch.arange(64, dtype=torch.uint8)
    swapped = raw.clone()
    swapped[0:4], swapped[8:12] = raw[8:12].clone(), raw[0:4].clone()
    assert _digest(raw) != _digest(swapped)
    monkeypatch.setattr(dd, "K1", 0)
    monkeypatch.setattr(dd, "K3", 0)
    assert _digest(raw) == _digest(swapped), "a position-blind sum should not tell two swapped words apart"
