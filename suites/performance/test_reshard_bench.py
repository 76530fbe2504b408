"""The resharding bench (harness.reshard.gpu_bench), small, on CPU: the same code the GPU run uses, with
shared-memory CPU tensors where the GPU has CUDA IPC handles. Every engine rank's shards equal the oracle
bit for bit after the timed rounds, each (N, M) moves exactly the plan's minimum, and both files are
written. Times are printed, never gated (a 2-core CI machine's milliseconds mean little)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.reshard.gpu_bench import COLUMNS, main

pytestmark = pytest.mark.multiproc


def _check(out, device: str) -> None:
    data = json.loads((out / "reshard_bench.json").read_text())
    rows = data["rows"]
    cases = [(r["trainers"], r["engines"]) for r in rows]
    assert cases == [(0, 1), (1, 1), (1, 2), (2, 1), (2, 2)], (
        f"expected the baseline then N, M in 1..2: {cases}"
    )
    wrong = {(r["trainers"], r["engines"]): r["wrong"] for r in rows if r["wrong"]}
    assert not wrong, f"{device}: engine shards differ from harness.reshard.oracle: {wrong}"
    off = {
        (r["trainers"], r["engines"]): (r["moved"], r["minimum"])
        for r in rows[1:]
        if r["moved"] != r["minimum"]
    }
    assert not off, f"{device}: engine ranks copied (moved, minimum) bytes: {off}"
    table = (out / "reshard_bench.md").read_text()
    assert "| " + " | ".join(COLUMNS) + " |" in table, table
    assert sum(line.startswith("| ") for line in table.splitlines()) == 2 + len(rows), table


def test_bench_on_cpu_fills_every_shard_bit_for_bit_and_moves_the_minimum(tmp_path, capsys):
    args = ["--device", "cpu", "--small", "--out", str(tmp_path), "--warmup", "1", "--repeats", "3"]
    assert main(args) == 0, f"python -m harness.reshard.gpu_bench {' '.join(args)} found wrong shards"
    print(capsys.readouterr().out)
    _check(tmp_path, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_on_one_gpu_over_cuda_ipc_fills_every_shard_bit_for_bit(tmp_path):
    args = ["--device", "cuda", "--small", "--out", str(tmp_path), "--warmup", "1", "--repeats", "3"]
    assert main(args) == 0, f"python -m harness.reshard.gpu_bench {' '.join(args)} found wrong shards"
    _check(tmp_path, "cuda")
