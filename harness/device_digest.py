"""A checksum computed where the tensor lives: on the GPU, one memory-bound pass (a Triton kernel), so
verifying a version costs a fraction of moving it; xxh3 stays for tensors on the host.

The algorithm, `ws64x2`, on the tensor's bytes zero-padded to whole 32-bit words w_i (i = 0..n-1, n < 2^32):

    x_i = mix(w_i XOR (i * K1), K2, 16)        y_i = mix(w_i XOR (i * K3), K4, 13)
    mix(v, k, s) = ((v * k) mod 2^32) XOR (((v * k) mod 2^32) >> s)
    digest = ((sum x_i + nbytes * K2) mod 2^64, sum y_i mod 2^64)  as "ws64x2:" + 32 hex digits

Each mix is a bijection of w_i for a fixed i, and each term is below 2^32, so a change confined to one word
(any single flipped bit, any change inside one 4-byte word) always changes both sums: detection is certain,
not probable. The index enters every term, so moving or swapping words changes the sums too, except by a
coincidence of two independent 64-bit sums. Sums commute, so the GPU may add in any order and any grouping
and get the same bits as `reference_digest` below, which does the same arithmetic with torch ops (on any
device; the property tests run it on the CPU, the GPU run checks the kernel against it).

Why one file: the Triton kernel, the torch reference it must match bit for bit and the dispatch between them are
one algorithm; apart, what must change together would not.
"""

from __future__ import annotations

import functools

import torch

PREFIX = "ws64x2:"
K1, K2, K3, K4 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F  # odd: multiplication mod 2^32 is a bijection
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_CHUNK_WORDS = 1 << 24  # the torch-ops reference works in chunks: int64 temporaries of 128 MiB at most
BLOCK = 1024  # words per program per step of the kernel's loop


def is_device_digest(text: str) -> bool:
    return text.startswith(PREFIX)


def _words(raw: torch.Tensor) -> torch.Tensor:
    """The bytes (flat uint8) as int32 words, zero-padded to a whole word (a copy only when needed)."""
    n = raw.numel()
    if n % 4 or raw.data_ptr() % 4:
        padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=raw.device)
        padded[:n].copy_(raw)
        raw = padded
    return raw.view(torch.int32)


def _format(sx: int, sy: int, nbytes: int) -> str:
    # the length enters too: bytes that differ only by trailing zeros padded to the same word differ
    return f"{PREFIX}{(sx + nbytes * K2) & _M64:016x}{sy & _M64:016x}"


# ------------------------------------------------------------------------------------------ reference
def _mix(v: torch.Tensor, k: int, shift: int) -> torch.Tensor:
    v = (v * k) & _M32  # int64 products wrap past 2^63; the low 32 bits are exact either way
    return v ^ (v >> shift)


def reference_sums(words: torch.Tensor) -> tuple[int, int]:
    """ws64x2 of int32 words with torch ops (any device): the definition the kernel must match."""
    n = words.numel()
    if n >= 1 << 32:
        raise ValueError(f"ws64x2 covers tensors under 16 GiB; got {n} words")
    sx = sy = 0
    for start in range(0, n, _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS].to(torch.int64) & _M32
        i = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        sx += int(_mix(w ^ ((i * K1) & _M32), K2, 16).sum())  # terms < 2^32, a chunk's sum < 2^56: exact
        sy += int(_mix(w ^ ((i * K3) & _M32), K4, 13).sum())
    return sx & _M64, sy & _M64


def reference_digest(raw: torch.Tensor) -> str:
    """ws64x2 of a flat uint8 tensor with torch ops."""
    return _format(*reference_sums(_words(raw)), raw.numel())


# ------------------------------------------------------------------------------------------ Triton
try:  # the kernels' shared pieces; every kernel is built on first use (harness runs without Triton too)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _terms(raw, offs, mask, k1, k2, k3, k4, WIDE: tl.constexpr):
        """The two ws64x2 terms of each word (int32 `raw` at word index `offs`), 0 where masked, as uint64."""
        w = raw.to(tl.uint32, bitcast=True)
        i = offs.to(tl.uint32)
        if WIDE:  # 64-bit products masked to 32 bits: right whatever type the constants get
            w64 = w.to(tl.uint64)
            i64 = i.to(tl.uint64)
            x = (((w64 ^ ((i64 * k1.to(tl.uint64)) & 0xFFFFFFFF)) * k2.to(tl.uint64)) & 0xFFFFFFFF).to(
                tl.uint32
            )
            y = (((w64 ^ ((i64 * k3.to(tl.uint64)) & 0xFFFFFFFF)) * k4.to(tl.uint64)) & 0xFFFFFFFF).to(
                tl.uint32
            )
        else:  # uint32 products wrap mod 2^32: what the definition says
            x = (w ^ (i * k1.to(tl.uint32))) * k2.to(tl.uint32)
            y = (w ^ (i * k3.to(tl.uint32))) * k4.to(tl.uint32)
        x = x ^ (x >> 16)
        y = y ^ (y >> 13)
        return tl.where(mask, x, tl.zeros_like(x)).to(tl.uint64), tl.where(mask, y, tl.zeros_like(y)).to(
            tl.uint64
        )

    @triton.jit
    def _mixed(raw, ix, iy, u2, u4):
        """The two ws64x2 terms of each word with its index terms i*K1, i*K3 given (uint32)."""
        w = raw.to(tl.uint32, bitcast=True)
        x = (w ^ ix) * u2
        y = (w ^ iy) * u4
        return x ^ (x >> 16), y ^ (y >> 13)

    @triton.jit
    def _store_partials(partial_ptr, t, nprog, pid, acc_x, acc_y):
        """This program's two sums for tensor `t` into partial[t, pid, :]."""
        base = partial_ptr + (t * nprog + pid) * 2
        tl.store(base, tl.sum(acc_x, axis=0).to(tl.int64, bitcast=True))
        tl.store(base + 1, tl.sum(acc_y, axis=0).to(tl.int64, bitcast=True))


_status: dict[str, str] = {}


def kernel_status() -> str:
    """'triton (...)' when the kernel runs (it matched the reference at first use), else why not; and
    whether the many-tensor kernel runs."""
    if _kernel() is not None:
        _many_kernel()
    return "; ".join(v for v in (_status.get("kernel", "not tried"), _status.get("many")) if v)


@functools.cache
def _kernel() -> tuple[object, bool] | None:
    """The Triton kernel and its variant (wide: 64-bit arithmetic), the first variant that matches the
    reference on first use; None where Triton or a GPU is missing or no variant matches (then the
    torch-ops reference runs: slower, the same bits)."""
    kernel = _build_kernel()
    if kernel is None:
        _status["kernel"] = "no Triton: torch-ops reference"
        return None
    if not torch.cuda.is_available():
        _status["kernel"] = "no GPU: torch-ops reference"
        return None
    why = []
    for wide in (False, True):  # 32-bit products first: one multiply each, where 64-bit ones take three
        try:
            problem = _self_test(kernel, wide)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run falls back, and says why
            problem = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        if problem is None:
            _status["kernel"] = f"triton ({'64' if wide else '32'}-bit products)"
            return kernel, wide
        why.append(f"{'64' if wide else '32'}-bit variant {problem}")
    _status["kernel"] = "torch-ops reference: " + "; ".join(why)
    return None


def _self_test(kernel, wide: bool) -> str | None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 1023, 1 << 20 | 7):
        words = torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int32, device="cuda", generator=gen)
        out = torch.zeros(2, dtype=torch.int64, device="cuda")
        _run(kernel, wide, words, out)
        got = tuple(v & _M64 for v in out.cpu().tolist())
        want = reference_sums(words)
        if got != want:
            return f"disagrees with the reference at {n} words ({got} != {want})"
    return None


def _run(kernel, wide: bool, words: torch.Tensor, out: torch.Tensor) -> None:
    n = words.numel()
    blocks = (n + BLOCK - 1) // BLOCK
    programs = min(_programs(words.device.index or 0) if words.device.type == "cuda" else 3, blocks)
    kernel[(programs,)](
        words, n, (blocks + programs - 1) // programs, out, K1, K2, K3, K4, BLOCK=BLOCK, WIDE=wide
    )


def _build_kernel():
    if triton is None:
        return None

    @triton.jit
    def ws64x2_kernel(
        words_ptr, n_words, iters, out_ptr, k1, k2, k3, k4, BLOCK: tl.constexpr, WIDE: tl.constexpr
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        acc_x = tl.zeros([BLOCK], dtype=tl.uint64)
        acc_y = tl.zeros([BLOCK], dtype=tl.uint64)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        for it in range(0, iters):  # grid-stride: few programs, few atomics
            offs = (pid + it * nprog).to(tl.int64) * BLOCK + lanes
            mask = offs < n_words
            dx, dy = _terms(tl.load(words_ptr + offs, mask=mask, other=0), offs, mask, k1, k2, k3, k4, WIDE)
            acc_x += dx
            acc_y += dy
        tl.atomic_add(out_ptr, tl.sum(acc_x, axis=0).to(tl.int64, bitcast=True))
        tl.atomic_add(out_ptr + 1, tl.sum(acc_y, axis=0).to(tl.int64, bitcast=True))

    return ws64x2_kernel


@functools.cache
def _programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count * 8


def launch(words: torch.Tensor, out: torch.Tensor, wide: bool | None = None) -> None:
    """Add ws64x2 of `words` (int32, on a GPU) into `out` (2 int64 on the same GPU), asynchronously.
    `wide` forces a kernel variant (the GPU run times both); None: the one chosen at first use."""
    n = words.numel()
    if n >= 1 << 32:
        raise ValueError(f"ws64x2 covers tensors under 16 GiB; got {n} words")
    chosen = _kernel() if words.device.type == "cuda" else None
    if chosen is None:
        sx, sy = reference_sums(words)
        out += torch.tensor(
            [sx - (1 << 64) if sx >= 1 << 63 else sx, sy - (1 << 64) if sy >= 1 << 63 else sy],
            dtype=torch.int64,
            device=out.device,
        )
        return
    if n == 0:
        return
    _run(chosen[0], chosen[1] if wide is None else wide, words, out)


def device_digests(raws: list[torch.Tensor]) -> list[str]:
    """ws64x2 of each flat uint8 tensor (all on one device), then one transfer of the results to the
    host. On a GPU, one launch covers every tensor: the bucket kernel's (segment, chunk) grid where every
    tensor starts on a 16-byte boundary, else the many-tensor kernel (an address table), where they
    passed their checks; else one launch per tensor."""
    if not raws:
        return []
    device = raws[0].device
    words = [_words(raw) for raw in raws]  # kept alive until the results are read
    out = torch.zeros((len(raws), 2), dtype=torch.int64, device=device)
    plan = _as_segments(words) if device.type == "cuda" and _bucket_kernel() is not None else None
    if plan is not None:
        _run_bucket(plan[0], None, plan[1], out)
    elif device.type == "cuda" and _many_kernel() is not None:
        _run_many(words, out)
    else:
        for k, w in enumerate(words):
            launch(w, out[k])
    return [
        _format(int(a), int(b), raw.numel()) for (a, b), raw in zip(out.cpu().tolist(), raws, strict=True)
    ]


def _as_segments(words: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
    """Separate tensors as segments of one address range: the lowest one's first word as the base, each
    tensor's offset in words from it (the GPU's addresses are flat). None where a tensor does not start
    on a 16-byte boundary (the kernel's wide accesses assume it) or one is too long for the grid."""
    base = min(words, key=lambda w: w.data_ptr())
    at = base.data_ptr()
    if at % 16 or any((w.data_ptr() - at) % 16 for w in words):
        return None
    if not _fits_grid(max(w.numel() for w in words)):
        return None
    return base, [((w.data_ptr() - at) // 4, w.numel()) for w in words]


# ------------------------------------------------------------------------------------------ many tensors
@functools.cache
def _many_kernel():
    """One launch for a list of tensors (addresses in a table, as Triton's grouped GEMM does): per-tensor
    launches cost ~20 us each, more than the GPU needs for a 16 MiB tensor. Checked like the other."""
    chosen = _kernel()
    if chosen is None:
        return None
    kernel = _build_many_kernel()
    try:
        gen = torch.Generator(device="cuda").manual_seed(1)
        tensors = [
            torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int32, device="cuda", generator=gen)
            for n in (1, 1023, 1 << 20 | 7, 5, 300_001)
        ]
        out = torch.zeros((len(tensors), 2), dtype=torch.int64, device="cuda")
        _run_many(tensors, out, kernel=(kernel, chosen[1]))
        got = [tuple(v & _M64 for v in row) for row in out.cpu().tolist()]
        want = [reference_sums(t) for t in tensors]
        if got != want:
            _status["many"] = f"many-tensor kernel disagrees with the reference ({got[:2]} != {want[:2]})"
            return None
    except Exception as exc:  # noqa: BLE001 - falls back to one launch per tensor, and says why
        _status["many"] = f"many-tensor kernel failed: {type(exc).__name__}: {str(exc)[:300]}"
        return None
    _status["many"] = "one launch for many tensors"
    return kernel, chosen[1]


def _run_many(words: list[torch.Tensor], out: torch.Tensor, kernel=None) -> None:
    kernel, wide = kernel or _many_kernel()
    device = words[0].device
    table = torch.tensor([[w.data_ptr(), w.numel()] for w in words], dtype=torch.int64).to(
        device, non_blocking=True
    )
    most = max(w.numel() for w in words)
    programs = max(1, min(_programs(device.index or 0), (most + BLOCK - 1) // BLOCK))
    partial = torch.empty((len(words), programs, 2), dtype=torch.int64, device=device)
    kernel[(programs,)](table, len(words), partial, K1, K2, K3, K4, BLOCK=BLOCK, WIDE=wide)
    out += partial.sum(dim=1)  # int64 sums wrap mod 2^64: the same as adding in the kernel


def _build_many_kernel():
    @triton.jit
    def ws64x2_many_kernel(
        table_ptr, n_tensors, partial_ptr, k1, k2, k3, k4, BLOCK: tl.constexpr, WIDE: tl.constexpr
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        for t in range(0, n_tensors):
            words_ptr = tl.load(table_ptr + 2 * t).to(tl.pointer_type(tl.int32))
            n_words = tl.load(table_ptr + 2 * t + 1)
            blocks = (n_words + BLOCK - 1) // BLOCK
            iters = (blocks - pid + nprog - 1) // nprog  # this program's blocks of tensor t (may be 0)
            acc_x = tl.zeros([BLOCK], dtype=tl.uint64)
            acc_y = tl.zeros([BLOCK], dtype=tl.uint64)
            for it in range(0, iters):
                offs = (pid + it * nprog).to(tl.int64) * BLOCK + lanes
                mask = offs < n_words
                dx, dy = _terms(
                    tl.load(words_ptr + offs, mask=mask, other=0), offs, mask, k1, k2, k3, k4, WIDE
                )
                acc_x += dx
                acc_y += dy
            _store_partials(partial_ptr, t, nprog, pid, acc_x, acc_y)

    return ws64x2_many_kernel


# ------------------------------------------------------------------------------------------ copy + digest
@functools.cache
def _copy_kernel():
    """Copy words out of a received buffer into their own tensors and digest them in the same pass: the
    receiver reads each byte once, where a copy then a digest read it twice. Checked like the others."""
    chosen = _kernel()
    if chosen is None or _many_kernel() is None:
        return None
    kernel = _build_copy_kernel()
    try:
        gen = torch.Generator(device="cuda").manual_seed(3)
        srcs = [
            torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int32, device="cuda", generator=gen)
            for n in (1, 1023, 1 << 20 | 7, 300_001)
        ]
        dsts = [torch.full_like(s, -1) for s in srcs]  # poisoned: every word must be written
        out = torch.zeros((len(srcs), 2), dtype=torch.int64, device="cuda")
        _run_copy(srcs, dsts, out, kernel=(kernel, chosen[1]))
        got = [tuple(v & _M64 for v in row) for row in out.cpu().tolist()]
        if got != [reference_sums(s) for s in srcs] or not all(torch.equal(s, d) for s, d in zip(srcs, dsts)):
            _status["copy"] = "copy+digest kernel disagrees with the reference or copies wrong bytes"
            return None
    except Exception as exc:  # noqa: BLE001 - the receiver then copies and digests separately, and says why
        _status["copy"] = f"copy+digest kernel failed: {type(exc).__name__}: {str(exc)[:300]}"
        return None
    _status["copy"] = "copy+digest in one pass"
    return kernel, chosen[1]


def copy_kernel_available() -> bool:
    return torch.cuda.is_available() and _copy_kernel() is not None


def _run_copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor], out: torch.Tensor, kernel=None) -> None:
    kernel, wide = kernel or _copy_kernel()
    device = srcs[0].device
    table = torch.tensor(
        [[s.data_ptr(), d.data_ptr(), s.numel()] for s, d in zip(srcs, dsts, strict=True)], dtype=torch.int64
    ).to(device, non_blocking=True)
    most = max(s.numel() for s in srcs)
    programs = max(1, min(_programs(device.index or 0), (most + BLOCK - 1) // BLOCK))
    partial = torch.empty((len(srcs), programs, 2), dtype=torch.int64, device=device)
    kernel[(programs,)](table, len(srcs), partial, K1, K2, K3, K4, BLOCK=BLOCK, WIDE=wide)
    out += partial.sum(dim=1)


def copy_and_digest(raws: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[str]]:
    """Fresh copies of flat uint8 GPU tensors (each 4-byte aligned) and their ws64x2 digests, in one pass.
    A copy's storage is rounded up to whole words; the tensor returned has exactly the source's bytes."""
    words = [_words(r) for r in raws]
    dsts = [torch.empty_like(w) for w in words]
    out = torch.zeros((len(raws), 2), dtype=torch.int64, device=raws[0].device)
    _run_copy(words, dsts, out)
    copies = [d.view(torch.uint8)[: r.numel()] for d, r in zip(dsts, raws, strict=True)]
    sums = [_format(int(a), int(b), r.numel()) for (a, b), r in zip(out.cpu().tolist(), raws, strict=True)]
    return copies, sums


def _build_copy_kernel():
    @triton.jit
    def ws64x2_copy_kernel(
        table_ptr, n_tensors, partial_ptr, k1, k2, k3, k4, BLOCK: tl.constexpr, WIDE: tl.constexpr
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        for t in range(0, n_tensors):
            src_ptr = tl.load(table_ptr + 3 * t).to(tl.pointer_type(tl.int32))
            dst_ptr = tl.load(table_ptr + 3 * t + 1).to(tl.pointer_type(tl.int32))
            n_words = tl.load(table_ptr + 3 * t + 2)
            blocks = (n_words + BLOCK - 1) // BLOCK
            iters = (blocks - pid + nprog - 1) // nprog
            acc_x = tl.zeros([BLOCK], dtype=tl.uint64)
            acc_y = tl.zeros([BLOCK], dtype=tl.uint64)
            for it in range(0, iters):
                offs = (pid + it * nprog).to(tl.int64) * BLOCK + lanes
                mask = offs < n_words
                raw = tl.load(src_ptr + offs, mask=mask, other=0)
                tl.store(dst_ptr + offs, raw, mask=mask)
                dx, dy = _terms(raw, offs, mask, k1, k2, k3, k4, WIDE)
                acc_x += dx
                acc_y += dy
            _store_partials(partial_ptr, t, nprog, pid, acc_x, acc_y)

    return ws64x2_copy_kernel


# ------------------------------------------------------------------------------------------ a whole bucket
# The bucket kernel's schedule: a 2-D grid of (segment, chunk) programs, each streaming CHUNK contiguous
# words of one segment in BLOCK-word steps (full steps unmasked, one masked tail). The index terms i*K1
# and i*K3 advance by a constant per step (an add where the definition has a multiply; the same bits).
# Chosen on an H200 from the sweep in harness.gpu_check (digest_sweep); a segment of more than
# CHUNK * 65535 words (the grid's second dimension) is copied per tensor instead.
CHUNK_CONFIG = {"BLOCK": 1024, "CHUNK": 1 << 15, "num_warps": 4, "STREAM": False}
_MAX_CHUNKS = 65535


def _fits_grid(words: int) -> bool:
    """Whether a segment of `words` words fits the grid under CHUNK_CONFIG (else: per-tensor kernels)."""
    return words <= CHUNK_CONFIG["CHUNK"] * _MAX_CHUNKS


@functools.cache
def _bucket_kernel():
    """The (segment, chunk) grid kernel: copy a whole bucket into one new buffer and digest each tensor's
    range of it in the same pass, or digest only. Two base pointers the compiler knows are aligned and
    offsets it is told are whole 16-byte units, so the loads and stores are wide (a table of per-tensor
    addresses hides the alignment: run 4 measured such a kernel at 0.57 of the speed). Checked like the
    others, under CHUNK_CONFIG."""
    chosen = _kernel()
    if chosen is None:
        return None
    kernel = _build_chunk_kernel()
    try:
        problem = _bucket_self_test(kernel, CHUNK_CONFIG)
    except Exception as exc:  # noqa: BLE001 - the tensor-table kernel is used instead, and says why
        _status["bucket"] = f"bucket kernel failed: {type(exc).__name__}: {str(exc)[:300]}"
        return None
    if problem is not None:
        _status["bucket"] = problem
        return None
    _status["bucket"] = "whole-bucket copy+digest, (segment, chunk) grid"
    return kernel


def _bucket_self_test(kernel, config: dict, device: str = "cuda", scale: int = 1) -> str | None:
    """None when `kernel` under `config` copies every word of each segment and gives the reference's
    sums; else what went wrong. Segments start at multiples of 4 words, with gaps, as alignment leaves;
    sizes straddle BLOCK and CHUNK (scale shrinks them for the CPU interpreter)."""
    gen = torch.Generator(device=device).manual_seed(5)
    chunk = config["CHUNK"]
    sizes = [4, 1020, config["BLOCK"] + 12, 8, chunk + 4, (3 * chunk) // scale + 4 * 77, 300_000 // scale]
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += (n + 3) // 4 * 4 + 4
    src = torch.randint(-(1 << 31), 1 << 31, (at,), dtype=torch.int32, device=device, generator=gen)
    # gathered in reverse order into a buffer of their own: the `to` column is read, not assumed
    tos, end = [], 0
    for n in reversed(sizes):
        tos.insert(0, end)
        end += (n + 3) // 4 * 4 + 8
    for where in (starts, tos):
        dst = torch.full((max(at, end),), -1, dtype=torch.int32, device=device)
        out = torch.zeros((len(sizes), 2), dtype=torch.int64, device=device)
        _run_bucket(src, dst, list(zip(starts, sizes, where, strict=True)), out, kernel, config)
        got = [tuple(v & _M64 for v in row) for row in out.cpu().tolist()]
        want = [reference_sums(src[s : s + n]) for s, n in zip(starts, sizes, strict=True)]
        if got != want:
            return f"bucket kernel {config} disagrees with the reference ({got[:2]} != {want[:2]})"
        copied = zip(starts, sizes, where, strict=True)
        if not all(torch.equal(src[s : s + n], dst[d : d + n]) for s, n, d in copied):
            return f"bucket kernel {config} copies wrong bytes"
    return None


def _run_bucket(
    src: torch.Tensor,
    dst: torch.Tensor | None,
    segments: list[tuple[int, int]],
    out: torch.Tensor,
    kernel=None,
    config: dict | None = None,
    hash_words: bool = True,
) -> None:
    """Add each segment's ws64x2 sums into out[k] (int64, contiguous, on src's device) and copy its words
    from src into dst. A segment is (start, words) — copied to the same offset of dst — or (start, words,
    to): copied to offset `to` of dst (scattered sources gathered into one buffer). dst None: digest only;
    hash_words False: copy only (the sweep times the schedule's bare copy). Offsets are in words from
    src's (dst's) first word and may be negative; every one a multiple of 4 words (16 bytes)."""
    kernel = kernel or _bucket_kernel()
    config = config or CHUNK_CONFIG
    chunk = config["CHUNK"]
    segments = [tuple(seg) if len(seg) == 3 else (seg[0], seg[1], seg[0]) for seg in segments]
    most = max(n for _, n, _ in segments)
    chunks = max(1, (most + chunk - 1) // chunk)
    if chunks > _MAX_CHUNKS:
        raise ValueError(f"a segment of {most} words exceeds the grid ({chunk} x {_MAX_CHUNKS})")
    kernel[(len(segments), chunks)](
        src,
        src if dst is None else dst,
        _segment_table(tuple(segments), src.device),
        out,
        K1,
        K2,
        K3,
        K4,
        CHUNK=chunk,
        BLOCK=config["BLOCK"],
        COPY=dst is not None,
        HASH=hash_words,
        # STREAM: each byte is read once and written once, so keep neither in cache
        LOAD_POLICY="evict_first" if config.get("STREAM") else "",
        STORE_CACHE=".cs" if config.get("STREAM") else "",
        num_warps=config["num_warps"],
    )


@functools.lru_cache(maxsize=64)
def _segment_table(segments: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
    """The (start, words, to) table on the device, kept per bucket plan: a sync repeats the same plan, and
    a host-to-device copy per bucket costs more than a small bucket's kernel."""
    return torch.tensor(segments, dtype=torch.int64).to(device)


def copy_and_digest_bucket(
    buf: torch.Tensor, ranges: list[tuple[int, int]]
) -> tuple[torch.Tensor, list[str]] | None:
    """One copy of a GPU bucket (flat uint8) and the ws64x2 digest of each (byte offset, byte length) range
    of it, in one pass; None where that cannot be done exactly (no kernel, a range not a whole number of
    words, not 16-byte aligned or too long for the grid): the caller copies per tensor then."""
    if (
        buf.device.type != "cuda"
        or buf.numel() % 4
        or buf.data_ptr() % 16
        or not ranges
        or any(off % 16 or n % 4 for off, n in ranges)
        or not _fits_grid(max(n for _, n in ranges) // 4)
        or _bucket_kernel() is None
    ):
        return None
    src = buf.view(torch.int32)
    dst = torch.empty_like(src)
    out = torch.zeros((len(ranges), 2), dtype=torch.int64, device=buf.device)
    _run_bucket(src, dst, [(off // 4, n // 4) for off, n in ranges], out)
    sums = [_format(int(a), int(b), n) for (a, b), (_, n) in zip(out.cpu().tolist(), ranges, strict=True)]
    return dst.view(torch.uint8), sums


def copy_and_digest_gathered(raws: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[str]] | None:
    """Flat uint8 GPU tensors anywhere on one device (e.g. a trainer's storages mapped by CUDA IPC) copied
    into one new buffer, each tensor's copy at a 16-byte boundary of it, and digested in the same pass:
    one launch and one transfer of the sums, whatever the number of tensors. Returns (copies, digests);
    None where that cannot be done exactly (no kernel, a tensor not a whole number of 16-byte-aligned
    words, one too long for the grid): the caller copies per tensor then."""
    if not raws or any(r.device.type != "cuda" or r.numel() % 4 for r in raws) or _bucket_kernel() is None:
        return None
    words = [r.view(torch.int32) for r in raws]
    plan = _as_segments(words)
    if plan is None:
        return None
    base, segments = plan
    tos, end = [], 0
    for w in words:
        tos.append(end)
        end += (w.numel() + 3) // 4 * 4
    dst = torch.empty(max(end, 4), dtype=torch.int32, device=base.device)
    out = torch.zeros((len(raws), 2), dtype=torch.int64, device=base.device)
    _run_bucket(base, dst, [(s, n, to) for (s, n), to in zip(segments, tos, strict=True)], out)
    copies = [dst[to : to + w.numel()].view(torch.uint8) for w, to in zip(words, tos, strict=True)]
    sums = [_format(int(a), int(b), r.numel()) for (a, b), r in zip(out.cpu().tolist(), raws, strict=True)]
    return copies, sums


def _build_chunk_kernel():
    if triton is None:
        return None

    @triton.jit
    def ws64x2_chunk_kernel(
        src_ptr,
        dst_ptr,
        seg_ptr,
        out_ptr,
        k1,
        k2,
        k3,
        k4,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        COPY: tl.constexpr,
        HASH: tl.constexpr,
        LOAD_POLICY: tl.constexpr,
        STORE_CACHE: tl.constexpr,
    ):
        t = tl.program_id(0)
        c = tl.program_id(1)
        start = tl.multiple_of(tl.load(seg_ptr + 3 * t), 4)  # whole 16-byte units: wide accesses
        n_words = tl.load(seg_ptr + 3 * t + 1)
        to = tl.multiple_of(tl.load(seg_ptr + 3 * t + 2), 4)  # where the copy goes, from dst's first word
        first = c.to(tl.int64) * CHUNK
        here = tl.minimum(tl.maximum(n_words - first, 0), CHUNK)  # this program's words
        full = (here // BLOCK).to(tl.int32)
        src = src_ptr + (start + first)
        dst = dst_ptr + (to + first)
        lanes = tl.arange(0, BLOCK)
        u1, u2, u3, u4 = k1.to(tl.uint32), k2.to(tl.uint32), k3.to(tl.uint32), k4.to(tl.uint32)
        i = first.to(tl.uint32) + lanes.to(tl.uint32)  # word index in the segment, mod 2^32
        ix = i * u1
        iy = i * u3
        step_x = tl.full([], BLOCK, tl.uint32) * u1
        step_y = tl.full([], BLOCK, tl.uint32) * u3
        acc_x = tl.zeros([BLOCK], dtype=tl.uint64)
        acc_y = tl.zeros([BLOCK], dtype=tl.uint64)
        for it in range(0, full):  # whole steps: no masks
            offs = it * BLOCK + lanes
            raw = tl.load(src + offs, eviction_policy=LOAD_POLICY)
            if COPY:
                tl.store(dst + offs, raw, cache_modifier=STORE_CACHE)
            if HASH:
                x, y = _mixed(raw, ix, iy, u2, u4)
                acc_x += x.to(tl.uint64)
                acc_y += y.to(tl.uint64)
                ix += step_x
                iy += step_y
        rest = here - full * BLOCK
        if rest > 0:  # the segment's last, partial step
            offs = full * BLOCK + lanes
            mask = lanes < rest
            raw = tl.load(src + offs, mask=mask, other=0)
            if COPY:
                tl.store(dst + offs, raw, mask=mask)
            if HASH:
                x, y = _mixed(raw, ix, iy, u2, u4)
                acc_x += tl.where(mask, x, tl.zeros_like(x)).to(tl.uint64)
                acc_y += tl.where(mask, y, tl.zeros_like(y)).to(tl.uint64)
        if HASH:  # sums commute mod 2^64: atomics in any order give the same bits
            tl.atomic_add(out_ptr + 2 * t, tl.sum(acc_x, axis=0).to(tl.int64, bitcast=True))
            tl.atomic_add(out_ptr + 2 * t + 1, tl.sum(acc_y, axis=0).to(tl.int64, bitcast=True))

    return ws64x2_chunk_kernel


def _build_strided_bucket_kernel():
    """The bucket kernel before the (segment, chunk) grid (runs 5-6): every program walks every segment,
    grid-strided. Kept only so the sweep times the two in one run."""

    @triton.jit
    def ws64x2_bucket_kernel(
        src_ptr,
        dst_ptr,
        seg_ptr,
        n_segments,
        partial_ptr,
        k1,
        k2,
        k3,
        k4,
        BLOCK: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        for t in range(0, n_segments):
            start = tl.multiple_of(tl.load(seg_ptr + 2 * t), 4)  # whole 16-byte units: wide accesses
            n_words = tl.load(seg_ptr + 2 * t + 1)
            blocks = (n_words + BLOCK - 1) // BLOCK
            iters = (blocks - pid + nprog - 1) // nprog
            acc_x = tl.zeros([BLOCK], dtype=tl.uint64)
            acc_y = tl.zeros([BLOCK], dtype=tl.uint64)
            for it in range(0, iters):
                local = (pid + it * nprog).to(tl.int64) * BLOCK + lanes
                mask = local < n_words
                raw = tl.load(src_ptr + start + local, mask=mask, other=0)
                tl.store(dst_ptr + start + local, raw, mask=mask)
                dx, dy = _terms(raw, local, mask, k1, k2, k3, k4, WIDE)
                acc_x += dx
                acc_y += dy
            _store_partials(partial_ptr, t, nprog, pid, acc_x, acc_y)

    return ws64x2_bucket_kernel


def _run_strided_bucket(src, dst, segments, out, kernel) -> None:
    table = torch.tensor(segments, dtype=torch.int64).to(src.device, non_blocking=True)
    most = max(n for _, n in segments)
    programs = max(1, min(_programs(src.device.index or 0), (most + BLOCK - 1) // BLOCK))
    partial = torch.empty((len(segments), programs, 2), dtype=torch.int64, device=src.device)
    kernel[(programs,)](src, dst, table, len(segments), partial, K1, K2, K3, K4, BLOCK=BLOCK, WIDE=False)
    out += partial.sum(dim=1)
