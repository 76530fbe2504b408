"""`weightsync validate-cluster --engine vllm`: the smoke's rollout side is real vLLM (a dev-mode server per
rollout rank, serving the tier's tiny Llama), the trainer's tensors go over the torchrun world's gloo fabric,
and what vLLM serves after the full update and after the ~1% patch is checked bit for bit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def test_validate_cluster_smoke_into_real_vllm_is_bitwise(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "harness.cli", "validate-cluster", "--trainer-ranks", "0", "--rollout-ranks", "1"]
    cmd += [
        "--engine",
        "vllm",
        "--sizes-mib",
        "1",
        "--repeats",
        "1",
        "--timeout-s",
        "300",
        "--peer-share",
        "0",
    ]
    cmd += ["--out", str(tmp_path)]
    from harness.engines.tiny_hf_models import TINY_LLAMA, build

    # the tiny model is built here, before torchrun: in a worker of rank > 0 transformers' save_pretrained writes
    # nothing (measured: "save_pretrained wrote []"); a short TMPDIR: vLLM's unix sockets under it have 107 bytes
    short = tempfile.mkdtemp(prefix="ws-vc-", dir="/tmp")
    build(TINY_LLAMA, Path(short) / "models")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TMPDIR": short,
        "WEIGHTSYNC_MODEL_CACHE": str(Path(short) / "models"),
    }
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=560, cwd=tmp_path, env=env, check=False
    )
    out = proc.stdout + proc.stderr
    report = tmp_path / "validate-cluster.json"
    assert report.exists(), f"exit {proc.returncode}, no report:\n{out[-3000:]}"
    data = json.loads(report.read_text())
    assert proc.returncode == 0 and data["verdict"] == "PASS", f"{data['reasons']}\n{out[-3000:]}"
    line = r"smoke: full update and ~1% patch into the vllm engine on 1 rollout rank\(s\) in [0-9.]+ s: bitwise equal"
    assert re.search(line, proc.stdout), out[-3000:]
