"""SIGINT/SIGTERM end bench and validate-cluster within STOP_BOUND_S whatever they wait on, write the partial
bundle where there is one, and leave no process behind (issue 40, item 2; certify's stop is in
test_certify_resume.py). Each test signals a command while it waits on a collective: bench's broadcast rows
mid-run, and validate-cluster's rank 0 in a gloo broadcast to a rank that stopped (SIGSTOP) mid-smoke."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.procs import pid_alive, process_state
from harness.stopping import STOP_BOUND_S, descendants

pytestmark = [pytest.mark.meta, pytest.mark.multiproc, pytest.mark.serial]  # stop bounds

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "CI": "true"}


def _wait_for(what, check, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        for p in procs:
            assert p.poll() is None, f"exited {p.returncode} before {what}:\n{p.log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _stop_and_time(proc: subprocess.Popen, sig: int) -> float:
    proc.send_signal(sig)
    t0 = time.monotonic()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    return time.monotonic() - t0


def _reap(procs: list[subprocess.Popen], started: list[int]) -> None:
    """SIGKILL what the test started, should the stop have left any (the test's own processes only)."""
    for pid in [p.pid for p in procs] + started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait()


REPEATS = 80


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_bench_stopped_mid_run_ends_within_the_bound_and_writes_its_rows(tmp_path, sig):
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--backend", "broadcast", "--receivers", "2"]
    # repeats: rows long enough that the stop lands inside the second (the bare row alone took 30 s at 200)
    cmd += ["--sizes-mib", "1", "4", "--repeats", str(REPEATS), "--out", str(tmp_path)]
    proc = _start(cmd, tmp_path / "bench.log", ENV)
    started: list[int] = []
    try:
        # the bare row measured: the ranks are deployed and the next row's broadcasts are under way
        _wait_for("first row", lambda: "[progress] bench: 1/3 rows" in proc.log.read_text(), 180, [proc])
        time.sleep(1.0)
        started = descendants(proc.pid)
        assert started, "bench runs its receivers as processes of its own: none found"
        took = _stop_and_time(proc, sig)
    finally:
        _reap([proc], started)
    out = proc.log.read_text()
    assert proc.returncode == 128 + sig, f"exit {proc.returncode}:\n{out[-2000:]}"
    assert took < STOP_BOUND_S, f"bench took {took:.1f} s to stop (bound {STOP_BOUND_S} s):\n{out[-2000:]}"
    left = [pid for pid in started if pid_alive(pid)]
    assert not left, f"processes bench started outlived it: {left}"
    bundle = next(tmp_path.glob("bench-*"), None)
    assert bundle is not None, f"no partial bundle:\n{out[-2000:]}"
    data = json.loads((bundle / "results.json").read_text())
    # a row measured before the stop may have failed its floor: FAIL is found, PASS would be a claim
    assert data.get("stopped") and data["verdict"] in ("STOPPED", "FAIL"), (
        data["verdict"],
        data.get("stopped"),
    )
    assert 1 <= len(data["rows"]) < 3, f"{len(data['rows'])} rows: the stop came after every row was measured"
    assert "stopped by" in (bundle / "report.md").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validate_cluster_stopped_in_a_collective_wait_ends_within_the_bound(tmp_path):
    """Two ranks as torchrun would start them (its environment, no torchrun: the test signals the rank itself);
    rank 1 SIGSTOPs itself mid-smoke, so rank 0 waits in a gloo broadcast whose timeout is 300 s."""
    port = _free_port()
    args = ["--trainer-ranks", "0", "--rollout-ranks", "1", "--device", "cpu", "--sizes-mib", "1"]
    args += ["--repeats", "1", "--hang-rank", "1", "--out", str(tmp_path)]
    procs = []
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, "-m", "harness.cli", "validate-cluster", *args]
        procs.append(_start(cmd, tmp_path / f"rank{rank}.log", env))
    rank0, rank1 = procs
    started: list[int] = []
    try:
        _wait_for("rank 1 stopped mid-smoke", lambda: process_state(rank1.pid) == "T", 180, [rank0])
        time.sleep(1.0)  # rank 0 is in the smoke's next broadcast, waiting for rank 1
        started = descendants(rank0.pid)
        took = _stop_and_time(rank0, signal.SIGTERM)
    finally:
        _reap(procs, started)
    out = rank0.log.read_text()
    assert rank0.returncode == 128 + signal.SIGTERM, f"exit {rank0.returncode}:\n{out[-2000:]}"
    assert took < STOP_BOUND_S, f"rank 0 took {took:.1f} s to stop (bound {STOP_BOUND_S} s):\n{out[-2000:]}"
    left = [pid for pid in started if pid_alive(pid)]
    assert not left, f"processes rank 0 started outlived it: {left}"
    report = json.loads((tmp_path / "validate-cluster.json").read_text())
    assert report["verdict"] == "STOPPED" and report["links"], report
    assert "stopped by SIGTERM during the smoke" in report["reasons"][0], report["reasons"]


def test_a_stop_during_the_commit_stays_a_stop(tmp_path):
    """A SIGINT or SIGTERM that lands while engine 1 commits, after engine 0 did, must leave push as the stop
    it is (so the command exits 130 or 143), the partial commit noted on it, not turned into a
    PartialCommitError (exit 1): seen once in CI as a bench stopped mid-row exiting 1."""
    from harness import bench
    from harness.api import spec_of
    from harness.backends.ipc import IpcBackend
    from harness.deployment import push

    weights = bench.payload(1 << 20, 4, seed=3)
    with IpcBackend().deploy(2, spec_of(weights), str(tmp_path)) as dep:
        push(dep, 1, weights)
        receiver = dep.handles[1].receiver

        def stopped(version):
            raise SystemExit(128 + signal.SIGINT)  # what harness.stopping raises on SIGINT

        receiver.finish_weight_update = stopped
        with pytest.raises(SystemExit) as raised:
            push(dep, 2, weights)
        assert raised.value.code == 130, raised.value
        notes = getattr(raised.value, "__notes__", [])
        assert any("after engine(s) [0] committed" in n for n in notes), notes
