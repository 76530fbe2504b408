"""Per-version manifest: what a version holds, how to check it, and how it packs into byte buckets.

Tensors are handled as raw bytes (a uint8 view), so bf16 and fp8 move bit-exact and NaN payloads
and -0.0 survive: no arithmetic ever touches a value on its way through a path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import xxhash

from harness import device_digest, host_digest, phases
from harness.api import ManifestMismatch, TensorSpec

# safetensors' dtype names: the manifest speaks the checkpoint format's language.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}

BUCKET_ALIGN = 16  # every tensor starts 16-byte aligned inside a bucket so typed views are legal
DEFAULT_BUCKET_BYTES = 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ManifestMismatch(f"dtype {dtype} is not supported by the manifest") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES_BY_NAME[name]
    except KeyError:
        raise ManifestMismatch(f"unknown dtype name {name!r}; known: {sorted(DTYPES_BY_NAME)}") from None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view (or contiguous copy) of the tensor's bytes; works for 0-d and empty tensors."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # e.g. a 1-element slice with stride 2 counts as contiguous
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def from_bytes(raw: torch.Tensor, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of as_bytes: reinterpret a flat uint8 tensor as (shape, dtype) without converting."""
    return raw.view(dtype).reshape(tuple(shape))


def digest(tensor: torch.Tensor) -> str:
    """The digest a manifest records for this tensor: xxh3-128 of its bytes on the host, ws64x2
    (harness.device_digest) computed on the GPU where it lives there."""
    return digests([tensor])[0]


def xxh3_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of the tensor's raw bytes (a host copy first for a device tensor)."""
    raw = as_bytes(tensor)
    if raw.device.type != "cpu":
        raw = raw.cpu()
    return xxhash.xxh3_128_hexdigest(memoryview(raw.numpy()))


def digests(tensors: list[torch.Tensor], algorithm: str = "auto") -> list[str]:
    """Digests of many tensors. 'auto': ws64x2 on the device for GPU tensors (every launch queued before
    one transfer of the results), xxh3 for host tensors; 'xxh3' or 'ws64x2' force one algorithm."""
    if algorithm not in DIGEST_ALGORITHMS:
        raise ValueError(f"digest algorithm {algorithm!r}: one of {DIGEST_ALGORITHMS}")
    out: list[str | None] = [None] * len(tensors)
    on_device: dict[torch.device, list[int]] = {}
    on_host: list[int] = []
    for k, t in enumerate(tensors):
        use_device = algorithm == "ws64x2" or (algorithm == "auto" and t.device.type == "cuda")
        if use_device:
            on_device.setdefault(t.device, []).append(k)
        else:
            on_host.append(k)
    for k, d in zip(on_host, host_digest.map_hash([tensors[k] for k in on_host], xxh3_digest), strict=True):
        out[k] = d  # over the host's cores: xxhash releases the GIL
    for ks in on_device.values():
        for k, d in zip(ks, device_digest.device_digests([as_bytes(tensors[k]) for k in ks]), strict=True):
            out[k] = d
    return out  # type: ignore[return-value]


def digests_like(tensors: list[torch.Tensor], recorded: list[str]) -> list[str]:
    """Each tensor's digest with the algorithm of the digest it is checked against."""
    algos = ["ws64x2" if device_digest.is_device_digest(r) else "xxh3" for r in recorded]
    out: list[str | None] = [None] * len(tensors)
    for algo in set(algos):
        ks = [k for k, a in enumerate(algos) if a == algo]
        for k, d in zip(ks, digests([tensors[k] for k in ks], algo), strict=True):
            out[k] = d
    return out  # type: ignore[return-value]


DIGEST_ALGORITHMS = ("auto", "xxh3", "ws64x2")


def _align(n: int) -> int:
    return (n + BUCKET_ALIGN - 1) // BUCKET_ALIGN * BUCKET_ALIGN


def bucket_plan(nbytes: Iterable[int], bucket_bytes: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(bucket, offset) of each tensor of these byte sizes, in order, and the buckets' sizes: packed into
    buckets of at most `bucket_bytes` at aligned offsets, a tensor larger than that in a bucket of its own.
    The plan alone, without digests (Manifest.build digests and then places by it)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    placements: list[tuple[int, int]] = []
    sizes: list[int] = []
    used = None  # bytes used in the open bucket; None: no bucket open
    for n in nbytes:
        if used is None or (used > 0 and _align(used) + n > bucket_bytes):
            sizes.append(0)
            used = 0
        offset = _align(used)
        used = offset + n
        sizes[-1] = used
        placements.append((len(sizes) - 1, offset))
    return placements, sizes


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name
    nbytes: int
    digest: str
    bucket: int
    offset: int  # byte offset inside its bucket

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.torch_dtype)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Names, shapes, dtypes, byte sizes and digests of one version, plus its bucket plan."""

    version: int
    entries: tuple[TensorEntry, ...]
    bucket_sizes: tuple[int, ...]

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        version: int,
        named_tensors: Mapping[str, torch.Tensor],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        digest_algorithm: str = "auto",
    ) -> Manifest:
        """Digest every tensor (`digests`: on the GPU for GPU tensors) and pack them, in the given order,
        into buckets of at most `bucket_bytes` (a tensor larger than that gets a bucket of its own)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        items = list(named_tensors.items())
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise ManifestMismatch(
                    f"version {version}: {name!r} is a {type(tensor).__name__}, not a tensor"
                )
        with phases.phase("digest"):
            sums = digests([t for _, t in items], digest_algorithm)
        nbytes = [t.numel() * t.element_size() for _, t in items]
        placements, sizes = bucket_plan(nbytes, bucket_bytes)
        entries = tuple(
            TensorEntry(
                name=name,
                shape=tuple(tensor.shape),
                dtype=dtype_name(tensor.dtype),
                nbytes=n,
                digest=tensor_digest,
                bucket=bucket,
                offset=offset,
            )
            for (name, tensor), tensor_digest, n, (bucket, offset) in zip(
                items, sums, nbytes, placements, strict=True
            )
        )
        return cls(version=version, entries=entries, bucket_sizes=tuple(sizes))

    # ------------------------------------------------------------------ queries
    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorEntry]:
        return {e.name: e for e in self.entries}

    def entry(self, name: str) -> TensorEntry:
        e = self._by_name.get(name)
        if e is not None:
            return e
        raise ManifestMismatch(f"version {self.version}: tensor {name!r} is not in the manifest")

    def bucket_entries(self, bucket: int) -> list[TensorEntry]:
        return [e for e in self.entries if e.bucket == bucket]

    # ------------------------------------------------------------------ checks
    def verify(self, name: str, tensor: torch.Tensor) -> None:
        """Raise ManifestMismatch naming the tensor and version unless it matches its entry bit for bit."""
        e = self.entry(name)
        if tuple(tensor.shape) != e.shape or dtype_name(tensor.dtype) != e.dtype:
            raise ManifestMismatch(
                f"version {self.version}: tensor {name!r} arrived as {tuple(tensor.shape)} "
                f"{dtype_name(tensor.dtype)}, manifest says {e.shape} {e.dtype}"
            )
        self._check_digests([(e, tensor)])

    def verify_all(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """`verify` for every tensor given, with the device digests of a GPU batched (one transfer)."""
        with phases.phase("verify"):
            self._verify_all(named_tensors)

    def _verify_all(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        pairs = []
        for name, tensor in named_tensors.items():
            e = self.entry(name)
            if tuple(tensor.shape) != e.shape or dtype_name(tensor.dtype) != e.dtype:
                self.verify(name, tensor)  # raises, naming what differs
            pairs.append((e, tensor))
        self._check_digests(pairs)

    def wrong(self, named_tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Names of the entries whose tensor is missing or differs from its digest (#wrong of a table)."""
        present = [e for e in self.entries if e.name in named_tensors]
        got = digests_like([named_tensors[e.name] for e in present], [e.digest for e in present])
        bad = {e.name for e, d in zip(present, got, strict=True) if d != e.digest}
        return [e.name for e in self.entries if e.name not in named_tensors or e.name in bad]

    def _check_digests(self, pairs: list[tuple[TensorEntry, torch.Tensor]]) -> None:
        got = digests_like([t for _, t in pairs], [e.digest for e, _ in pairs])
        for (e, _), d in zip(pairs, got, strict=True):
            if d != e.digest:
                raise ManifestMismatch(
                    f"version {self.version}: tensor {e.name!r} digest {d} != manifest {e.digest} "
                    f"({e.nbytes} bytes): the payload was corrupted or truncated"
                )

    # ------------------------------------------------------------------ buckets
    def pack_bucket(
        self,
        bucket: int,
        named_tensors: Mapping[str, torch.Tensor],
        device=None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One flat uint8 buffer holding every tensor of `bucket` at its planned offset (written into
        `out` when given, e.g. straight into a shared-memory segment, saving a copy)."""
        with phases.phase("pack"):
            return self._pack_bucket(bucket, named_tensors, device, out)

    def _pack_bucket(self, bucket, named_tensors, device, out) -> torch.Tensor:
        size = self.bucket_sizes[bucket]
        if out is None:
            buf = torch.zeros(size, dtype=torch.uint8, device=device)
        else:
            if out.dtype != torch.uint8 or out.numel() != size:
                raise ValueError(f"out must be {size} uint8 bytes, got {out.numel()} {out.dtype}")
            buf = out
            previous_end = 0
            for e in self.bucket_entries(bucket):  # alignment gaps must not carry stale bytes
                buf[previous_end : e.offset].zero_()
                previous_end = e.offset + e.nbytes
        for e in self.bucket_entries(bucket):
            if e.nbytes:
                buf[e.offset : e.offset + e.nbytes].copy_(as_bytes(named_tensors[e.name]))
        return buf

    def unpack_bucket(
        self, bucket: int, buf: torch.Tensor, verified: set[str] | None = None, adopt: bool = False
    ) -> dict[str, torch.Tensor]:
        """Typed copies of every tensor of `bucket` out of its flat buffer. With `verified` (a set the
        caller owns) and a GPU buffer whose entries carry device digests, the copies are digested in the
        same pass (harness.device_digest.copy_and_digest), a mismatch raises here, and the names that
        passed are added to `verified`: the receiver need not read them again. With `adopt` (a host
        buffer that is the caller's to give away, e.g. freshly received) the tensors are views of it: no copy."""
        with phases.phase("unpack"):
            return self._unpack_bucket(bucket, buf, verified, adopt)

    def _unpack_bucket(
        self, bucket: int, buf: torch.Tensor, verified: set[str] | None, adopt: bool
    ) -> dict[str, torch.Tensor]:
        if buf.numel() != self.bucket_sizes[bucket]:
            raise ManifestMismatch(
                f"version {self.version}: bucket {bucket} has {buf.numel()} bytes, plan says "
                f"{self.bucket_sizes[bucket]}"
            )
        entries = self.bucket_entries(bucket)
        return self._unpack_ranges(entries, [e.offset for e in entries], buf, verified, adopt)

    def unpack_ranges(
        self, entries: list[TensorEntry], offsets: list[int], buf: torch.Tensor, verified: set[str] | None
    ) -> dict[str, torch.Tensor]:
        """unpack_bucket for tensors that lie at `offsets` (bytes) of any flat buffer, e.g. a trainer's own
        storage mapped in place: copies (digested in the same pass on a GPU, as unpack_bucket says)."""
        with phases.phase("unpack"):
            return self._unpack_ranges(entries, offsets, buf, verified, adopt=False)

    def unpack_gathered(
        self, entries: list[TensorEntry], sources: list[torch.Tensor], verified: set[str]
    ) -> dict[str, torch.Tensor] | None:
        """Copies of tensors that lie anywhere on one GPU (flat uint8 views, e.g. of a trainer's storages
        mapped in place), gathered into one buffer and digested in the same pass: one launch and one
        transfer of the sums (device_digest.copy_and_digest_gathered). A mismatch raises; the names that
        passed join `verified`. None where that cannot be done: the caller unpacks buffer by buffer."""
        if not entries or not all(device_digest.is_device_digest(e.digest) for e in entries):
            return None
        with phases.phase("unpack"):
            got = device_digest.copy_and_digest_gathered(sources)
            if got is None:
                return None
            return self._verified_copies(entries, *got, verified)

    def _verified_copies(
        self, entries: list[TensorEntry], copies: list[torch.Tensor], sums: list[str], verified: set[str]
    ) -> dict[str, torch.Tensor]:
        for e, d in zip(entries, sums, strict=True):
            if d != e.digest:
                raise ManifestMismatch(
                    f"version {self.version}: tensor {e.name!r} digest {d} != manifest {e.digest} "
                    f"({e.nbytes} bytes): the payload was corrupted or truncated"
                )
        verified.update(e.name for e in entries)
        return {e.name: from_bytes(c, e.shape, e.torch_dtype) for e, c in zip(entries, copies, strict=True)}

    def _unpack_ranges(
        self,
        entries: list[TensorEntry],
        offsets: list[int],
        buf: torch.Tensor,
        verified: set[str] | None,
        adopt: bool,
    ) -> dict[str, torch.Tensor]:
        if (
            verified is not None
            and entries
            and buf.device.type == "cuda"
            and all(device_digest.is_device_digest(e.digest) for e in entries)
            and device_digest.copy_kernel_available()
        ):
            ranges = [(at, e.nbytes) for e, at in zip(entries, offsets, strict=True)]
            whole = device_digest.copy_and_digest_bucket(buf, ranges)
            if whole is not None:  # one copy of the buffer; each tensor a view of its range
                copy, sums = whole
                copies = [copy[at : at + n] for at, n in ranges]
            else:
                copies, sums = device_digest.copy_and_digest([buf[at : at + n] for at, n in ranges])
            return self._verified_copies(entries, copies, sums, verified)
        if adopt and buf.device.type == "cpu":
            return {
                e.name: from_bytes(buf[at : at + e.nbytes], e.shape, e.torch_dtype)
                for e, at in zip(entries, offsets, strict=True)
            }
        return {
            e.name: from_bytes(buf[at : at + e.nbytes].clone(), e.shape, e.torch_dtype)
            for e, at in zip(entries, offsets, strict=True)
        }

    # ------------------------------------------------------------------ wire format
    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "bucket_sizes": list(self.bucket_sizes),
            "entries": [
                {
                    "name": e.name,
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "nbytes": e.nbytes,
                    "digest": e.digest,
                    "bucket": e.bucket,
                    "offset": e.offset,
                }
                for e in self.entries
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and validate; anything malformed raises ManifestMismatch saying what."""
        try:
            version = data["version"]
            if not isinstance(version, int) or isinstance(version, bool):
                raise ManifestMismatch(f"manifest version must be an int, got {version!r}")
            sizes = tuple(int(s) for s in data["bucket_sizes"])
            entries = []
            for raw in data["entries"]:
                shape = tuple(int(d) for d in raw["shape"])
                dtype = str(raw["dtype"])
                dtype_from_name(dtype)
                nbytes = int(raw["nbytes"])
                expected = dtype_from_name(dtype).itemsize
                for d in shape:
                    expected *= d
                if nbytes != expected or any(d < 0 for d in shape):
                    raise ManifestMismatch(
                        f"manifest entry {raw['name']!r}: {nbytes} bytes does not fit shape {shape} {dtype}"
                    )
                bucket, offset = int(raw["bucket"]), int(raw["offset"])
                if not (0 <= bucket < len(sizes)) or offset < 0 or offset + nbytes > sizes[bucket]:
                    raise ManifestMismatch(f"manifest entry {raw['name']!r} lies outside bucket {bucket}")
                entries.append(
                    TensorEntry(str(raw["name"]), shape, dtype, nbytes, str(raw["digest"]), bucket, offset)
                )
        except ManifestMismatch:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestMismatch(f"malformed manifest: {type(exc).__name__}: {exc}") from None
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ManifestMismatch(f"manifest of version {version} lists a tensor twice")
        return cls(version=version, entries=tuple(entries), bucket_sizes=sizes)

    @classmethod
    def loads(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestMismatch(f"manifest is not valid JSON: {exc}") from None
        return cls.from_json(data)
