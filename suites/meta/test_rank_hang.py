"""No silent hang (issue 24, item 6): a rank that stops answering while a request streams fails every
caller within that caller's own deadline, with a RankFailure that names the rank, its pid and the call in
flight; the pipe's FifoLock survives a waiter that gives up or is interrupted (pytest-timeout's SIGALRM);
and a run stopped from outside records the test it hung in as failed, with the ranks' calls in flight."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness.api import GenerationRequest, RankFailure
from harness.backends.ipc import IpcBackend
from harness.launch.supervision import (
    RPC_SLACK,
    FifoLock,
    RankBusy,
    calls_in_flight,
    describe_calls_in_flight,
)
from harness.procs import process_state
from harness.report import EXIT_STATUS, FAIL, UNDECIDED, decide
from harness.suite_runs import fail_the_stopped_test

pytestmark = pytest.mark.meta

TIMEOUT_S = 2.0  # the backend's timeout: a rank call gets RPC_SLACK x this before its rank is killed
RANK_TIMEOUT_S = TIMEOUT_S * RPC_SLACK


class _Interrupted(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """SIGALRM raises _Interrupted in the main thread after `seconds`, as pytest-timeout's does; the
    test's own pytest-timeout timer is put back afterwards."""
    t0 = time.monotonic()

    def interrupt(signum, frame):
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 0.01))


def _until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.01)
    return result


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# ---------------------------------------------------------------------------------------------- FifoLock
def _held(lock: FifoLock) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds `lock` until the returned event is set."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(10)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(5)
    return t, release


def test_fifo_lock_waiter_that_times_out_does_not_block_the_next():
    lock = FifoLock()
    holder, release = _held(lock)
    assert lock.acquire(timeout=0.1) is False
    waiter, out = _in_thread(lambda: lock.acquire(timeout=5))
    release.set()
    holder.join(5)
    waiter.join(5)
    assert out.get("result") is True, f"the waiter behind a timed-out ticket: {out}"
    lock.release()
    assert lock.acquire(timeout=1)


def test_fifo_lock_waiter_interrupted_by_a_signal_does_not_block_the_next():
    lock = FifoLock()
    holder, release = _held(lock)
    with pytest.raises(_Interrupted), _alarm(0.1), lock:  # waits behind the holder until SIGALRM
        pass
    release.set()
    holder.join(5)

    def take() -> bool:
        with lock:
            return True

    waiter, out = _in_thread(take)
    waiter.join(5)
    assert out.get("result") is True, (
        "a waiter interrupted by a signal left a ticket that blocks every later one"
    )


def test_fifo_lock_serves_in_arrival_order_past_abandoned_tickets():
    lock = FifoLock()
    holder, release = _held(lock)
    order: list[int] = []
    threads = []
    for i in range(4):
        if i % 2:
            assert lock.acquire(timeout=0.05) is False  # an abandoned ticket between live ones
        queued = lock._next_ticket + 1
        t, _ = _in_thread(lambda i=i: (lock.acquire(timeout=5), order.append(i), lock.release()))
        threads.append(t)
        _until(lambda q=queued: lock._next_ticket >= q, 5, f"waiter {i} queued")
    release.set()
    for t in [holder, *threads]:
        t.join(5)
    assert order == [0, 1, 2, 3], order


# ----------------------------------------------------------------------------------- a rank that stops
@pytest.fixture
def stopped_rank(tmp_path):
    """A deployment of the ipc path (CPU) with one rank, a request streaming from it, then the rank
    stopped (SIGSTOP) while the engine's pump polls it: (deployment, rank, the stream)."""
    dep = IpcBackend(timeout_s=TIMEOUT_S).deploy(1, None, str(tmp_path))
    try:
        engine, rank = dep.handles[0].engine, dep.ranks[0]
        stream = engine.submit(GenerationRequest("hang-0", (3, 1, 4, 1, 5), 100_000))
        assert stream.wait_for_tokens(1, timeout=30)
        os.kill(rank.pid, signal.SIGSTOP)
        _until(lambda: process_state(rank.pid) == "T", 5, "the rank to stop")
        _until(  # a poll the stopped rank cannot answer (one answered just before the stop ends in ms)
            lambda: any(c.pid == rank.pid and c.op == "poll" and c.seconds > 0.2 for c in calls_in_flight()),
            5,
            "the pump's poll in flight on the stopped rank",
        )
        yield dep, rank, stream
    finally:
        for r in dep.ranks:
            if r.process.is_alive():
                os.kill(r.pid, signal.SIGCONT)
        dep.close()


@pytest.mark.multiproc
def test_a_caller_that_cannot_get_the_pipe_fails_at_its_own_deadline(stopped_rank):
    dep, rank, _ = stopped_rank
    report = describe_calls_in_flight()
    assert f"rank 1 (pid {rank.pid}) in 'poll' for " in report and "SIGSTOP" in report, report
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        rank.call("ping", timeout=0.3)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.2, (
        f"a call with a 0.3 s deadline waited {elapsed:.1f}s for the pipe (the poll holding it has "
        f"{RANK_TIMEOUT_S:g}s)"
    )
    message = str(info.value)
    assert f"rank 1 (pid {rank.pid})" in message and "'poll' in flight for" in message, message
    assert process_state(rank.pid) == "T", (
        "the waiting caller killed the rank: the holder's deadline does that"
    )


@pytest.mark.multiproc
def test_submit_and_pause_on_a_stopped_rank_raise_rank_failure_within_the_timeout(stopped_rank):
    dep, rank, stream = stopped_rank
    engine = dep.handles[0].engine
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        engine.submit(GenerationRequest("hang-1", (3, 1, 4), 8))
    elapsed = time.monotonic() - t0
    assert elapsed < RANK_TIMEOUT_S + 1.0, f"submit waited {elapsed:.1f}s on a stopped rank"
    assert f"rank 1 (pid {rank.pid})" in str(info.value), str(info.value)
    t0 = time.monotonic()
    with pytest.raises(RankFailure):
        engine.pause("abort")
    assert time.monotonic() - t0 < RANK_TIMEOUT_S + 1.0
    assert stream.result(timeout=5).finish_reason == "abort", "the stream of the lost rank did not end"
    assert not dep.healthy()


@pytest.mark.multiproc
def test_a_caller_interrupted_while_waiting_for_the_pipe_does_not_hang_later_callers(stopped_rank):
    dep, rank, _ = stopped_rank
    with pytest.raises(_Interrupted), _alarm(0.2):  # pytest-timeout ending a test that waits on the pipe
        rank.call("ping")
    _until(lambda: not rank.process.is_alive(), RANK_TIMEOUT_S + 5, "the poll's deadline killing the rank")
    caller, out = _in_thread(lambda: rank.call("ping", timeout=1.0))
    caller.join(RANK_TIMEOUT_S + 2)
    assert not caller.is_alive(), "a call after an interrupted one waits forever for the rank's pipe"
    assert isinstance(out.get("error"), RankFailure), out


@pytest.mark.multiproc
def test_a_begun_call_is_read_in_order_and_bounded_by_its_own_deadline(tmp_path):
    """RankProcess.begin (the driver overlaps its ranks' start with its prepare): the next call reads the
    begun reply first; on a stopped rank a caller behind a begun call gives up at its own deadline without
    killing the rank, which is killed at the begun call's deadline, as its result() says."""
    dep = IpcBackend(timeout_s=TIMEOUT_S).deploy(1, None, str(tmp_path))
    try:
        rank = dep.ranks[0]
        first = rank.begin("ping")
        assert rank.call("ping") == rank.pid, "a call read the begun call's reply as its own"
        assert first.done and first.result() == rank.pid
        os.kill(rank.pid, signal.SIGSTOP)
        _until(lambda: process_state(rank.pid) == "T", 5, "the rank to stop")
        begun = rank.begin("ping")
        assert begun.wait(0.2) is False, "a bounded wait on a stopped rank's reply said it was read"
        t0 = time.monotonic()
        with pytest.raises(RankBusy, match="'ping' in flight"):
            rank.call("ping", timeout=0.5)
        assert time.monotonic() - t0 < 1.5, "a caller behind a begun call outwaited its own deadline"
        assert process_state(rank.pid) == "T", "a caller behind a begun call killed the rank"
        with pytest.raises(RankFailure, match="no reply to ping"):
            begun.result()
        assert time.monotonic() - t0 < RANK_TIMEOUT_S + 2, "the begun call was not bounded by its deadline"
        assert not rank.healthy
    finally:
        for r in dep.ranks:
            if r.process.is_alive():
                os.kill(r.pid, signal.SIGCONT)
        dep.close()


# ------------------------------------------------------------------------ a run stopped from outside
HUNG_TEST = """
import os, subprocess, time
from pathlib import Path
from harness.launch import supervision

class _Process:
    def __init__(self, popen):
        self.popen = popen
    def is_alive(self):
        return self.popen.poll() is None
    def kill(self):
        self.popen.kill()

class _Rank:  # a rank of harness.launch.supervision's registry with a call in flight (the child stands in for it)
    def __init__(self, log):
        self.rank, self.log_path = 1, log
        self.process = _Process(subprocess.Popen(["sleep", "60"]))
        self.pid = self.process.popen.pid
        self._in_flight = ("poll", time.monotonic() - 95)

def test_hangs(tmp_path):
    rank = _Rank(tmp_path / "rank1.log")
    supervision._LIVE_RANKS.add(rank)
    ready = Path(os.environ["HANG_READY"])  # written whole, then named: the test signals once it exists
    partial = ready.with_suffix(".tmp")
    partial.write_text(str(rank.pid))
    partial.replace(ready)
    time.sleep(60)  # the hang
"""


def _hung_run(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(HUNG_TEST))
    results, ready = tmp_path / "results.json", tmp_path / "ready"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "test_hung.py",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
    ]
    cmd += ["--weightsync-backend=disk", "--weightsync-receivers=1", f"--weightsync-results={results}", *args]
    env = {**os.environ, "HANG_READY": str(ready), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, results, ready


def test_a_run_stopped_by_sigterm_records_the_hung_test_as_failed_with_the_calls_in_flight(tmp_path):
    proc, results, ready = _hung_run(tmp_path)
    try:
        _until(ready.exists, 60, "the test to hang")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    data = json.loads(results.read_text())
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, out.decode()[-2000:])
    assert not data["complete"] and data["running"] == "test_hung.py::test_hangs", data
    rec = data["tests"]["test_hung.py::test_hangs"]
    pid = int(ready.read_text())
    assert rec["status"] == "failed", rec
    assert rec["message"].startswith("hung: stopped after "), rec
    assert "in test_hung.py::test_hangs; " in rec["message"], rec
    assert f"rank 1 (pid {pid}) in 'poll' for 9" in rec["message"], rec
    assert "; stacks in " in rec["message"] and rec["message"].endswith("rank1.log"), rec
    assert b"hung: stopped after" in out and b"test_hangs" in out, out.decode()[-2000:]  # and its stacks
    assert process_state(pid) in ("?", "Z"), "the rank outlived the run that was stopped"
    # certify's reader: a hung test is a FAIL; a run stopped outside any test stays COULD NOT DECIDE
    fail_the_stopped_test(data, proc.returncode, tmp_path / "pytest.log")
    assert rec["message"].startswith("hung:"), "the plugin's own record was overwritten"
    assert decide({"disk": data}).verdict == FAIL
    between = {**data, "tests": {}, "running": None}
    fail_the_stopped_test(between, -signal.SIGKILL, tmp_path / "pytest.log")
    decision = decide({"disk": between})
    assert decision.verdict == UNDECIDED and decision.exit_status == EXIT_STATUS[UNDECIDED] == 3


def test_a_run_killed_during_a_test_without_a_record_fails_that_test():
    data = {"complete": False, "running": "t.py::test_x", "tests": {"t.py::test_ok": {"status": "passed"}}}
    fail_the_stopped_test(data, -signal.SIGKILL, Path("pytest.log"))
    rec = data["tests"]["t.py::test_x"]
    assert rec["status"] == "failed" and "killed by SIGKILL" in rec["message"], rec
    assert decide({"disk": data}).verdict == FAIL


def _hung_test_record(tmp_path: Path, *args: str) -> tuple[dict, Path]:
    """The hung test's record from a run that completes (its own limit in `args` ends the test), and the
    file its rank's pid is written to."""
    proc, results, ready = _hung_run(tmp_path, *args)
    out, _ = proc.communicate(timeout=60)
    data = json.loads(results.read_text())
    assert data["complete"], (data, out.decode()[-2000:])
    return data["tests"]["test_hung.py::test_hangs"], ready


def test_a_timed_out_test_names_the_rank_calls_in_flight(tmp_path):
    rec, _ = _hung_test_record(tmp_path, "--timeout=1")
    assert rec["status"] == "failed" and "Timeout" in rec["message"], rec
    assert "rank calls in flight: rank 1 (pid " in rec["message"] and "in 'poll' for 9" in rec["message"], rec


def test_a_test_past_its_deadline_fails_naming_the_calls_in_flight_and_the_run_goes_on(tmp_path):
    rec, ready = _hung_test_record(tmp_path, "--weightsync-test-deadline=2")
    assert rec["status"] == "failed" and "ran past its 2 s deadline" in rec["message"], rec
    assert "rank 1 (pid " in rec["message"] and "in 'poll' for 9" in rec["message"], rec
    assert rec["duration_s"] < 10, f"the deadline of 2 s ended the test after {rec['duration_s']} s"
    pid = int(ready.read_text())
    assert process_state(pid) in ("?", "Z"), "the rank holding the call was not killed"
