"""`weightsync validate-cluster` under torchrun on this machine (several gloo ranks over loopback): the table,
the smoke and the verdict; a floor above what the links can do fails naming every link; the arithmetic."""

from __future__ import annotations

import html
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.validate_cluster import Link, Steps, parse_ranks, payload_gbs, verdict

pytestmark = pytest.mark.multiproc
#: the ranks import this checkout's harness whatever is installed (they run in tmp_path)
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def _run(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["-m", "harness.cli", "validate-cluster", "--trainer-ranks", "0", "--rollout-ranks", "1-3"]
    cmd += ["--sizes-mib", "1", "4", "--repeats", "2", "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=ENV)
    report = tmp_path / "validate-cluster.json"
    assert report.exists(), f"exit {proc.returncode}, no report:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return proc, json.loads(report.read_text())


def test_four_ranks_measure_every_link_and_pass_the_smoke(tmp_path):
    # --peer-share 0: loopback links on a shared 2-core host differ by load alone; the peer check has a test below
    proc, report = _run(tmp_path, "--peer-share", "0")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and report["verdict"] == "PASS", f"{report['reasons']}\n{proc.stdout[-3000:]}"
    kinds = sorted((link["kind"], tuple(link["dst"]), link["size_bytes"]) for link in report["links"])
    expected = [("broadcast", (1, 2, 3), s) for s in (1 << 20, 4 << 20)]
    expected += [("p2p", (r,), s) for r in (1, 2, 3) for s in (1 << 20, 4 << 20)]
    assert kinds == sorted(expected), kinds
    assert all(link["gbs"] > 0 for link in report["links"]), report["links"]
    smoke_line = r"smoke: full update and ~1% patch into the reference engine on 3 rollout rank\(s\) in [0-9.]+ s: bitwise equal"
    assert re.search(smoke_line, proc.stdout), out[-3000:]
    # not a terminal: one plain line per step (8 measurements, 2 smoke versions, the report), no bar
    steps = re.findall(r"^\[(\d+)/11\] ", proc.stdout, re.M)
    assert steps == [str(i) for i in range(1, 12)] and "━" not in proc.stdout, proc.stdout[:2000]
    page = (tmp_path / "validate-cluster.html").read_text()
    assert '<div class="verdict PASS">PASS</div>' in page, page[:500]
    assert page.count('<td class="ns">no rating</td>') == len(report["links"]), page
    assert all(html.escape(link["ends"]) in page for link in report["links"]), page
    header = "<tr><th>kind</th><th>src</th><th>dst</th><th>ends</th><th>size (MiB)</th><th>time (ms)</th>"
    assert header in page and "<td>p2p</td><td>0</td><td>1</td><td>rank 0 (" in page, page[-3000:]


def test_a_rating_the_links_cannot_reach_fails_naming_each_link(tmp_path):
    proc, report = _run(tmp_path, "--rating-gbps", "100000")  # 100 Tb/s: no loopback reaches half of it
    assert proc.returncode != 0 and report["verdict"] == "FAIL", f"{report['reasons']}\n{proc.stdout[-3000:]}"
    for dst in (1, 2, 3):
        assert any(
            f"-> rank {dst} (" in r and "below the floor 5625.000 GB/s" in r for r in report["reasons"]
        ), report["reasons"]
    page = (tmp_path / "validate-cluster.html").read_text()
    assert '<div class="verdict FAIL">FAIL</div>' in page, page[:500]
    assert page.count('<td class="fail">below floor</td>') == len(report["links"]), page
    assert all(html.escape(r) in page for r in report["reasons"]), report["reasons"]


def test_rank_ranges_and_the_rating_in_payload_bytes():
    assert parse_ranks("0") == [0] and parse_ranks("1-3") == [1, 2, 3] and parse_ranks("0,4-5") == [0, 4, 5]
    with pytest.raises(ValueError, match="'1-x'"):
        parse_ranks("1-x")
    assert payload_gbs(400) == pytest.approx(45.0)  # NDR: 50 GB/s raw, ~45 of payload


def test_one_link_far_below_its_peers_is_named_without_a_rating():
    links = [Link("p2p", 0, [r], 1 << 30, 1.0, f"rank 0 -> rank {r}") for r in (1, 2, 3)]
    links.append(Link("p2p", 0, [4], 1 << 30, 10.0, "rank 0 -> rank 4 (node-b, cpu)"))
    result, reasons = verdict(links, None, [])
    assert result == "FAIL" and len(reasons) == 1 and "rank 0 -> rank 4 (node-b, cpu)" in reasons[0], reasons
    assert verdict(links[:3], None, [])[0] == "PASS"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launchers(layout: str) -> list[list[str]]:
    """'per-node': one torchrun per rank, as on a cluster of one-GPU nodes; 'one': a single torchrun for all
    four, which stops every worker (SIGTERM) as soon as one dies."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if layout == "one":
        return [[*run, "--standalone", "--nproc-per-node=4"]]
    port = _free_port()
    return [
        [*run, "--nnodes=4", "--nproc-per-node=1", f"--node-rank={i}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        for i in range(4)
    ]  # fmt: skip


def _kill_tree(pid: int) -> None:
    """SIGKILL pid and every process below it (a stopped worker takes nothing else)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        _kill_tree(int(child))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize(
    ("layout", "fault"), [("per-node", "kill"), ("one", "kill"), ("per-node", "hang")], ids=str
)
def test_a_rank_lost_mid_smoke_is_named_within_the_bound(tmp_path, layout, fault):
    """Rank 2 SIGKILLs itself after version 1 (its sockets close), or SIGSTOPs itself there (they stay open:
    only the timeout can tell). The survivors must not hang: every collective gives up after --timeout-s,
    and rank 0 names the rank that never reported in (under a single torchrun too: its SIGTERM to the
    survivors leaves them STOP_REPORT_S for the report)."""
    # Under one torchrun a survivor's collective must give up within STOP_REPORT_S of torchrun's SIGTERM for its
    # report to reach rank 0 (a stop ends within harness.stopping.STOP_BOUND_S): there --timeout-s 2, not 5
    # (with 5 it missed by a hair in a CI run, naming ranks 1 and 3 missing too)
    timeout_s = 2 if layout == "one" else 5
    args = ["-m", "harness.cli", "validate-cluster", "--trainer-ranks", "0", "--rollout-ranks", "1-3"]
    args += ["--sizes-mib", "1", "--repeats", "1", "--peer-share", "0", "--timeout-s", str(timeout_s)]
    args += [f"--{fault}-rank", "2", "--out", str(tmp_path)]
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [*launcher, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=ENV,
        )
        for launcher in _launchers(layout)
    ]
    # a stopped rank's own launcher waits on it for ever: the survivors' launchers are the ones to wait for
    waited = [p for i, p in enumerate(procs) if not (fault == "hang" and i == 2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in waited]
    finally:
        for p in procs:
            _kill_tree(p.pid)
            p.communicate()
    elapsed = time.monotonic() - t0
    report_file = tmp_path / "validate-cluster.json"
    assert report_file.exists(), "no report:\n" + "\n".join(o[-1500:] for o in outs)
    report = json.loads(report_file.read_text())
    reasons = report["reasons"]
    assert report["verdict"] == "FAIL" and report["missing_ranks"] == [2], (reasons, outs[0][-2000:])
    # within timeout_s + 5 s; under one torchrun sooner: its SIGTERM to the survivors cuts rank 0's wait to
    # STOP_REPORT_S after it (a stop ends within harness.stopping.STOP_BOUND_S)
    assert any(
        r.startswith("rank 2 (") and re.search(r"did not report within \d+ s of the smoke's start", r)
        for r in reasons
    ), reasons
    assert not any("did not report" in r for r in reasons if not r.startswith("rank 2 (")), reasons
    # bounded: a survivor's collective gives up within timeout_s, rank 0 waits 5 s more for the reports
    assert report["smoke_s"] < timeout_s + 5 + 2, f"smoke took {report['smoke_s']:.1f} s"
    assert all(p.returncode != 0 for p in waited), [p.returncode for p in waited]
    print(f"lost rank ({fault}) named after {report['smoke_s']:.1f} s of smoke, {elapsed:.1f} s in all")


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(monkeypatch):
    term = io.StringIO()
    bar = Steps(3, show=True, file=term, terminal=True)
    for what in ("p2p 0 -> 1, 1 MiB", "p2p 0 -> 2, 1 MiB", "report"):
        bar(what)
    bar.close()
    assert "━" in term.getvalue() and "[1/3]" not in term.getvalue(), repr(term.getvalue()[:300])
    monkeypatch.setenv("CI", "true")
    plain = io.StringIO()
    plain.isatty = lambda: True  # a terminal, but CI=true: plain lines
    lines = Steps(2, show=True, file=plain)
    lines("p2p 0 -> 1, 1 MiB")
    lines("report")
    assert plain.getvalue() == "[1/2] p2p 0 -> 1, 1 MiB\n[2/2] report\n", repr(plain.getvalue())
    quiet = io.StringIO()
    Steps(1, show=False, file=quiet)("p2p")  # every rank but 0
    assert quiet.getvalue() == ""
