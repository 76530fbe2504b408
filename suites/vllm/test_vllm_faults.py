"""The fault matrix (suites/faults) with real vLLM as the engine, over disk and broadcast: the cells that
apply to a fixed model with one receiver (kill, stall, trainer raise and kill, corruption, cut, blocked
read, full disk) run against vLLM inside rank processes; the rest report NOT_SUPPORTED with the reason.
A restarted rank starts a new vLLM engine, so the timeout is 10 s here instead of 4, and each fault runs
at its first named point only (the default tier runs every point against the reference engine).

Both columns run at once, each its own pytest process (started by the first test that needs one): most of
a column's minutes are its cells waiting out a stall's timeout, and the matrix's deadlines extend by what a
busy host keeps them waiting, so two columns side by side are judged as one alone is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("disk", "broadcast")
LIMIT_S = 1500  # a dozen cells, each starting vLLM ranks: minutes, past the 300 s default


def _command(backend: str, results: Path) -> list[str]:
    return [
        sys.executable, "-m", "pytest", "suites/faults/test_fault_matrix.py", "-q", "-p", "no:cacheprovider",
        "-p", "no:randomly", "--weightsync-engine=vllm", f"--weightsync-backend={backend}",
        "--weightsync-fault-timeout=10", f"--weightsync-results={results}",
        "--weightsync-fault-points=one",  # each cell starts vLLM ranks: one point per fault
    ]  # fmt: skip


@pytest.fixture(scope="module")
def columns(tmp_path_factory):
    """Every backend's column started at once: backend -> (process, command, its folder: results.json and
    stdout.txt)."""
    runs = {}
    for backend in BACKENDS:
        d = tmp_path_factory.mktemp(f"vllm-faults-{backend}")
        cmd = _command(backend, d / "results.json")
        with (d / "stdout.txt").open("w") as out:  # the child writes to its own copy of the descriptor
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
        runs[backend] = (proc, cmd, d)
    yield runs
    for proc, _, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(LIMIT_S)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fault_matrix_passes_with_vllm_as_the_engine(backend, columns):
    proc, cmd, d = columns[backend]
    try:
        returncode = proc.wait(timeout=LIMIT_S - 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        returncode = proc.wait()
    stdout = (d / "stdout.txt").read_text(errors="replace")
    results = d / "results.json"
    assert results.exists(), f"the fault suite wrote no results (exit {returncode}):\n{stdout[-3000:]}"
    data = json.loads(results.read_text())
    cells = {node: rec.get("fault_cell") or {} for node, rec in data["tests"].items()}
    bad = {node: c for node, c in cells.items() if c.get("verdict") in ("fail", "unknown")}
    assert not bad and returncode == 0, (
        f"{len(bad)} fault cell(s) not ok with vLLM over {backend} (exit {returncode}):\n"
        + "\n".join(
            f"- {c.get('fault')} ({c.get('point')}): {c.get('verdict')} {c.get('reasons')}"
            for c in bad.values()
        )
        + f"\n{stdout[-2000:]}\nrerun: python -m {' '.join(cmd[2:])}"
    )
    ok = sorted(c["fault"] for c in cells.values() if c.get("verdict") == "ok")
    # vLLM must have been exercised, not reported NOT_SUPPORTED throughout
    assert len(ok) >= 5 and data["complete"], f"only {ok} ok: {cells}"
