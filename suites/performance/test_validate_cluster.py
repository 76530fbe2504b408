"""`weightsync validate-cluster` under torchrun on this machine (several gloo ranks over loopback): the table,
the smoke and the verdict; a floor above what the links can do fails naming every link; the arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.validate_cluster import Link, parse_ranks, payload_gbs, verdict

pytestmark = pytest.mark.multiproc


def _run(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["-m", "harness.cli", "validate-cluster", "--trainer-ranks", "0", "--rollout-ranks", "1-3"]
    cmd += ["--sizes-mib", "1", "4", "--repeats", "2", "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
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
    assert "smoke: full update and ~1% patch to 3 rollout rank(s): bitwise equal" in proc.stdout, out[-3000:]


def test_a_rating_the_links_cannot_reach_fails_naming_each_link(tmp_path):
    proc, report = _run(tmp_path, "--rating-gbps", "100000")  # 100 Tb/s: no loopback reaches half of it
    assert proc.returncode != 0 and report["verdict"] == "FAIL", f"{report['reasons']}\n{proc.stdout[-3000:]}"
    for dst in (1, 2, 3):
        assert any(
            f"-> rank {dst} (" in r and "below the floor 5625.000 GB/s" in r for r in report["reasons"]
        ), report["reasons"]


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
