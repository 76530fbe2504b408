"""Sparse delta from version v to v+1, carried by another path's data plane (broadcast or ipc).

Sender: for every tensor, the elements whose raw bits changed since the last committed version are
shipped as (indices, values); a tensor falls back to dense when the patch would not be smaller or
its changed fraction passes `max_sparse_fraction` (extraction and scatter cost more per element than
a copy). Receiver: checks that it holds the base (engine version and per-tensor digest), applies the
patch into a staging copy, and the shared lifecycle verifies the result's digest before commit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from harness import phases
from harness.api import (
    JSON,
    BaseMismatch,
    ManifestMismatch,
    Sender,
)
from harness.manifest import Manifest, as_bytes, digest, digests_like, from_bytes
from harness.paths import delta_codec as codec
from harness.paths.base import StagingReceiver, manifest_of
from harness.paths.broadcast import BroadcastReceiver
from harness.paths.ipc import IpcReceiver

DEFAULT_MAX_SPARSE_FRACTION = 0.25


@dataclasses.dataclass
class DeltaStats:
    version: int
    dense_bytes: int = 0  # what a full sync would move
    moved_bytes: int = 0  # payload actually moved (indices + values + dense fallbacks)
    sparse_tensors: int = 0
    dense_tensors: int = 0
    changed_elements: int = 0
    total_elements: int = 0

    @property
    def ratio(self) -> float:
        return self.moved_bytes / self.dense_bytes if self.dense_bytes else 0.0


def encode_delta(
    base: Mapping[str, torch.Tensor] | None,
    new: Mapping[str, torch.Tensor],
    max_sparse_fraction: float,
    version: int,
    base_digests: Mapping[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, JSON], DeltaStats]:
    """Payload tensors (uint8) and per-tensor patch descriptors for base -> new (`base_digests`: the
    base's digests where already known, e.g. from the manifest it was sent with)."""
    payload: dict[str, torch.Tensor] = {}
    entries: dict[str, JSON] = {}
    stats = DeltaStats(version)
    for name, t in new.items():
        nbytes = t.numel() * t.element_size()
        stats.dense_bytes += nbytes
        stats.total_elements += t.numel()
        old = base.get(name) if base is not None else None
        sparse = None
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            idx = codec.changed_indices(old, t)
            stats.changed_elements += idx.numel()
            if idx.numel() <= max_sparse_fraction * t.numel():
                enc = codec.encode_indices(idx, t.numel())
                values = codec.gather_values(t, idx)
                if enc.data.numel() + values.numel() < nbytes:
                    known = (base_digests or {}).get(name)
                    sparse = (enc, values, known if known is not None else digest(old))
        else:
            stats.changed_elements += t.numel()
        if sparse is None:
            payload[f"{name}#dense"] = as_bytes(t)
            entries[name] = {"mode": "dense"}
            stats.dense_tensors += 1
            stats.moved_bytes += nbytes
        else:
            enc, values, base_digest = sparse
            payload[f"{name}#idx"] = enc.data
            payload[f"{name}#val"] = values
            entries[name] = {
                "mode": "sparse",
                "encoding": enc.encoding,
                "count": enc.count,
                "base_digest": base_digest,
            }
            stats.sparse_tensors += 1
            stats.moved_bytes += enc.data.numel() + values.numel()
    return payload, entries, stats


class DeltaSender(Sender):
    """Wraps a byte-moving sender; its base advances only when every engine committed."""

    def __init__(self, transport: Sender, max_sparse_fraction: float = DEFAULT_MAX_SPARSE_FRACTION):
        self.transport = transport
        self.max_sparse_fraction = max_sparse_fraction
        # (version, tensors, their manifest digests): the committed base, and the version in flight
        self._base: tuple[int, dict[str, torch.Tensor], dict[str, str]] | None = None
        self._pending: tuple[int, dict[str, torch.Tensor], dict[str, str]] | None = None
        self._spare: dict[str, torch.Tensor] = {}  # an older snapshot's memory, reused for the next one
        self.history: list[DeltaStats] = []
        self.last_payload: dict[str, torch.Tensor] = {}  # what the last prepare() shipped (for replay tests)

    @property
    def tap(self):  # the patch travels on the transport's data plane: interpose there
        return self.transport.tap

    @tap.setter
    def tap(self, tap) -> None:
        self.transport.tap = tap

    def init(self) -> JSON:
        return self.transport.init()

    def prepare(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> JSON:
        base_version, base, base_digests = self._base if self._base else (None, None, None)
        manifest = Manifest.build(version, named_tensors, bucket_bytes=1 << 62)
        with phases.phase("pack"):  # extracting the patch, and keeping this version as the next base
            payload, entries, stats = encode_delta(
                base, named_tensors, self.max_sparse_fraction, version, base_digests
            )
            if self._pending is not None:  # prepared, never completed
                self._spare = self._pending[1]
            self._pending = (
                version,
                self._snapshot(named_tensors),
                {e.name: e.digest for e in manifest.entries},
            )
        self.history.append(stats)
        self.last_payload = payload
        return {
            "manifest": manifest.to_json(),
            "delta": {"base_version": base_version, "entries": entries},
            "payload": self.transport.prepare(version, payload),
        }

    def transmit(self) -> None:
        self.transport.transmit()

    def _snapshot(self, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A private copy of this version (the trainer goes on changing its tensors), written into the
        spare snapshot's memory where every tensor fits: a warm copy instead of a fresh allocation."""
        spare, self._spare = self._spare, {}
        fits = spare.keys() == named_tensors.keys() and all(
            spare[n].shape == t.shape and spare[n].dtype == t.dtype and spare[n].device == t.device
            for n, t in named_tensors.items()
        )
        if fits:
            for n, t in named_tensors.items():
                spare[n].copy_(t.detach())
            return spare
        return {n: t.detach().clone() for n, t in named_tensors.items()}

    def complete(self, committed: bool) -> None:
        self.transport.complete(committed)
        if self._pending is not None:
            if committed:
                self._spare = self._base[1] if self._base else {}
                self._base = self._pending
            else:
                self._spare = self._pending[1]
        self._pending = None

    def reset(self) -> None:
        self._base = self._pending = None
        self._spare = {}
        self.transport.reset()

    def reset_base(self) -> None:
        self._base = None  # the next prepare() sends every tensor dense
        self._spare = {}

    def diagnose(self) -> list[str]:
        return self.transport.diagnose()

    def shutdown(self) -> None:
        self.transport.shutdown()


class DeltaReceiver(StagingReceiver):
    """Receives the payload with a transport receiver's data plane, then patches a staging copy."""

    transport_cls: type[StagingReceiver] = BroadcastReceiver

    def __init__(self, engine):
        super().__init__(engine)
        self.transport = self.transport_cls(engine)
        # one pool: the transport's own would never be trimmed (its finish is never called), and patch
        # payloads change size every sync
        self.transport.staging = self.staging
        self.must_drain = self.transport.must_drain

    def _init(self, init_info: JSON) -> None:
        self.transport._init(init_info)

    def _receive(self, manifest: Manifest, update_info: JSON) -> dict[str, torch.Tensor]:
        payload_info = dict(update_info.get("payload") or {})
        payload_manifest = manifest_of(payload_info)
        payload = self.transport._receive(payload_manifest, payload_info)
        with phases.phase("verify"):  # the patch itself must be intact before it is applied
            for name in payload_manifest.names:
                payload_manifest.verify(name, payload[name])
        delta = update_info.get("delta") or {}
        entries = delta.get("entries") or {}
        if sorted(entries) != sorted(manifest.names):
            raise ManifestMismatch(
                f"version {manifest.version}: delta entries do not match the manifest's tensors"
            )
        sparse = [n for n, e in entries.items() if e.get("mode") == "sparse"]
        if sparse and delta.get("base_version") != self.engine.weight_version:
            raise BaseMismatch(
                f"version {manifest.version}: patch made against version {delta.get('base_version')}, engine holds "
                f"version {self.engine.weight_version}; refused (send it dense, or the right patch)"
            )
        current = self._read_base(manifest, sparse)
        with phases.phase("unpack"):  # patching staging copies of the base
            return self._apply(manifest, entries, payload, current)

    def _read_base(self, manifest: Manifest, names: list[str]) -> dict[str, torch.Tensor]:
        """The committed values of the patched tensors, copied into staging memory (warm: reused once
        the engine lets go of it) that becomes the new version once patched in place."""
        base = {}
        device = self.engine_device()  # patched where the engine lives
        for name in names:
            e = manifest.entry(name)
            raw = (
                self.staging.take(e.nbytes)
                if device.type == "cpu"
                else torch.empty(e.nbytes, dtype=torch.uint8, device=device)  # the caching allocator's
            )
            base[name] = from_bytes(raw, e.shape, e.torch_dtype)
        with phases.phase("unpack"):
            self.engine.read_weights_into(base)
        return base

    def _apply(
        self,
        manifest: Manifest,
        entries: JSON,
        payload: dict[str, torch.Tensor],
        current: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, e in entries.items():
            spec = manifest.entry(name)
            if e.get("mode") == "dense":
                out[name] = from_bytes(payload[f"{name}#dense"], spec.shape, spec.torch_dtype).clone()
                continue
            base = current[name]
            with phases.phase("verify"):
                base_ok = digests_like([base], [str(e.get("base_digest"))])[0] == e.get("base_digest")
            if not base_ok:
                raise BaseMismatch(
                    f"version {manifest.version}: tensor {name!r} on the engine (version {self.engine.weight_version}) "
                    "is not the patch's base (digest differs); refused"
                )
            enc = codec.EncodedIndices(
                str(e.get("encoding")), payload[f"{name}#idx"], int(e.get("count", -1))
            )
            idx = codec.decode_indices(enc, base.numel())
            # the base was copied into staging memory (_read_base): patch that copy in place
            out[name] = codec.apply_patch(base, idx, payload[f"{name}#val"], in_place=True).reshape(
                spec.shape
            )
        return out

    def rebind(self, engine) -> None:
        super().rebind(engine)
        self.transport.engine = engine

    def _shutdown(self) -> None:
        self.transport._shutdown()


class DeltaIpcReceiver(DeltaReceiver):
    transport_cls = IpcReceiver
