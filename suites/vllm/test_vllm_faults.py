"""The fault matrix (suites/faults) with real vLLM as the engine, over disk and broadcast: the cells that
apply to a fixed model with one receiver (kill, stall, trainer raise and kill, corruption, cut, blocked
read, full disk) run against vLLM inside rank processes; the rest report NOT_SUPPORTED with the reason.
A restarted rank starts a new vLLM engine, so the timeout is 10 s here instead of 4, and each fault runs
at its first named point only (the default tier runs every point against the reference engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1500)  # a dozen cells, each starting vLLM ranks: minutes, past the 300 s default
@pytest.mark.parametrize("backend", ["disk", "broadcast"])
def test_fault_matrix_passes_with_vllm_as_the_engine(backend, tmp_path):
    results = tmp_path / "results.json"
    cmd = [
        sys.executable, "-m", "pytest", "suites/faults/test_fault_matrix.py", "-q", "-p", "no:cacheprovider",
        "-p", "no:randomly", "--weightsync-engine=vllm", f"--weightsync-backend={backend}",
        "--weightsync-fault-timeout=10", f"--weightsync-results={results}",
        "--weightsync-fault-points=one",  # each cell starts vLLM ranks: one point per fault
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500, check=False)
    assert results.exists(), (
        f"the fault suite wrote no results (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
    )
    data = json.loads(results.read_text())
    cells = {node: rec.get("fault_cell") or {} for node, rec in data["tests"].items()}
    bad = {node: c for node, c in cells.items() if c.get("verdict") in ("fail", "unknown")}
    assert not bad and proc.returncode == 0, (
        f"{len(bad)} fault cell(s) not ok with vLLM over {backend} (exit {proc.returncode}):\n"
        + "\n".join(
            f"- {c.get('fault')} ({c.get('point')}): {c.get('verdict')} {c.get('reasons')}"
            for c in bad.values()
        )
        + f"\n{proc.stdout[-2000:]}\nrerun: python -m {' '.join(cmd[2:])}"
    )
    ok = sorted(c["fault"] for c in cells.values() if c.get("verdict") == "ok")
    # vLLM must have been exercised, not reported NOT_SUPPORTED throughout
    assert len(ok) >= 5 and data["complete"], f"only {ok} ok: {cells}"
