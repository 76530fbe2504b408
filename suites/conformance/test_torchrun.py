"""The broadcast rank code under torchrun (the launcher used across hosts), not only under spawn."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.not_quick]  # 11 s a test on 2 cores


@pytest.mark.parametrize("receivers", [2, 3])
def test_broadcast_under_torchrun_delivers_every_version(receivers, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={receivers + 1}",
        "-m",
        "harness.torchrun_sync",
        "--steps",
        "3",
        "--timeout-s",
        "60",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-3000:]}\nrerun: {' '.join(cmd)}"
    assert f"OK: 3 versions to {receivers} receiver rank(s), #wrong 0" in proc.stdout, out[-3000:]
