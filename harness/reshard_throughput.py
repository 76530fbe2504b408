"""certify's and bench's throughput rows for the reshard backend, which serves one Llama-shaped model and
so cannot take the benchmark's payload of any size (`harness.bench.payload`): each row is a model of that
size instead (`model_of_size`, float32, the TP engine's dtype), pushed through the same `SyncBench` (the
median of the repeats, the gloo ceiling beside it, #wrong digested from every engine, the gate) and
judged by the plan as well: every push must move exactly the plan's minimum to each engine rank of each
engine, and R x the plan's total out of the trainer ranks; a push that does not counts as wrong."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable

import torch

from harness.api import Backend
from harness.bench import BARE_PAYLOAD_BYTES, ROW_ROUNDS, SyncBench, SyncRow, _versions, gate_for, measure_row
from harness.reshard.layout import ModelShape

HEADS, KV_HEADS, LAYERS = 8, 2, 2


def model_of_size(size_bytes: int) -> ModelShape:
    """A Llama-shaped model whose float32 checkpoint is about `size_bytes` (untied head, vocab 4 x hidden,
    intermediate 3 x hidden, hidden a multiple of 32 so TP 1, 2 and 4 split it); the TP engine's own
    model for the bare-lifecycle row."""
    if size_bytes <= BARE_PAYLOAD_BYTES:
        from harness.engines.tp_reference import TP_MODEL

        return TP_MODEL
    per_h2 = 2 * 4 + LAYERS * (1 + 2 * KV_HEADS / HEADS + 1 + 9)  # parameters per hidden**2
    hidden = max(64, round(math.sqrt(size_bytes / 4 / per_h2) / 32) * 32)
    return ModelShape(
        vocab=4 * hidden,
        hidden=hidden,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=hidden // HEADS,
        intermediate=3 * hidden,
        layers=LAYERS,
        tied=False,
    )


class ReshardSyncBench(SyncBench):
    """SyncBench over a model of about `size` bytes: the backend deploys that model, the payload is its
    checkpoint, and each push's bytes are checked against the plan (`plan_problems`)."""

    def __init__(self, backend, size: int, receivers: int, workdir: str, gate, repeats: int):
        model = model_of_size(size)
        super().__init__(
            backend.with_model(model), BARE_PAYLOAD_BYTES, receivers, workdir, gate, None, repeats
        )
        gen = torch.Generator().manual_seed(size)
        self.weights = {  # where the trainer holds them: the GPU variant's on its device (self.device)
            n: (torch.randn(s, generator=gen) * 0.02).to(self.device)
            for n, s in model.checkpoint_shapes().items()
        }
        self.nbytes = sum(t.numel() * t.element_size() for t in self.weights.values())
        self._versions = _versions(self.weights, 0.0, repeats * ROW_ROUNDS + 1)
        self.last = self.weights
        #: each push whose bytes were not the plan's minimum, as a sentence
        self.plan_problems: list[str] = []

    def push(self, weights) -> None:
        super().push(weights)
        dep = self.deployment
        minimum = dep.sender.plan(list(weights)).minimum_bytes()
        want = [minimum[f"engine {r}"] for r in range(dep.tp)]
        for q, receiver in enumerate(dep.receivers):
            if receiver.received_bytes != want:
                self.plan_problems.append(
                    f"engine {q} received {receiver.received_bytes} B per rank, plan {want}"
                )
        expected = dep.sender.expected_sent(minimum["total"])
        if sum(dep.sender.sent_bytes) != expected:
            self.plan_problems.append(
                f"trainer ranks sent {dep.sender.sent_bytes} B on the {dep.sender.plane} plane, plan "
                f"{expected} ({dep.replicas} replicas x {minimum['total']})"
            )

    def row(self) -> SyncRow:
        row = super().row()
        return dataclasses.replace(row, dtype="fp32", wrong=row.wrong + len(self.plan_problems))


def measure_sync(
    backend: Backend,
    sizes: list[int],
    receivers: int,
    repeats: int = 5,
    progress: Callable[[str], None] = lambda msg: None,
    floors: dict[str, float] | None = None,
    bare: bool = False,
    **_ignored,
) -> list[SyncRow]:
    """`harness.bench.measure_sync` for the reshard backend (the same rounds and gate; `engine` and the
    other sweeps' arguments do not apply: the backend serves its own TP engine)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="weightsync-reshard-bench-") as tmp:
        for size in ([BARE_PAYLOAD_BYTES] if bare else []) + list(sizes):
            with ReshardSyncBench(backend, size, receivers, tmp, gate_for(backend, floors), repeats) as bench:
                what = f"{bench.nbytes / 2**20:.1f} MiB" if size > BARE_PAYLOAD_BYTES else "bare lifecycle"
                row = measure_row(
                    bench, repeats, progress, f"{backend.name}: {receivers} receiver(s), {what}"
                )
                if bench.plan_problems:
                    print(f"reshard throughput: bytes off the plan: {bench.plan_problems[:3]}")
                rows.append(row)
    return rows
