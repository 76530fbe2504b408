"""The bucket-size sweep of `weightsync bench --bucket-mib`: a row deploys its path with that bucket size and
measures it against a ceiling of the same bucket plan; the report tabulates and draws the sweep apart from the
other scaling tables; a backend without buckets is refused, not silently measured at its own unit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.api import Backend, Capabilities
from harness.backends.broadcast import BroadcastBackend
from harness.backends.disk import DiskBackend
from harness.bench import SyncBench, SyncRow, payload
from harness.ceilings import make_ceiling
from harness.manifest import Manifest
from harness.perf_report import rows_from_results, write_perf_report


class NoBuckets(Backend):
    """A path without a bucket unit: deploy takes no bucket_bytes."""

    name = "no-buckets"
    capabilities = Capabilities()

    def deploy(self, n_receivers, spec, workdir, engine=None):  # pragma: no cover - never reached
        raise AssertionError("a refused bench deployed anyway")


def test_a_backend_without_buckets_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no-buckets") as info:
        SyncBench(NoBuckets(), 1 << 20, 1, str(tmp_path), bucket_bytes=1 << 20)
    assert "buckets" in str(info.value), f"the refusal does not say why: {info.value}"
    SyncBench(NoBuckets(), 1 << 20, 1, str(tmp_path))  # without bucket_bytes: its own unit, as before


def test_disk_ceiling_cuts_its_files_at_the_swept_bucket_size(tmp_path):
    weights = payload(4 << 20, 16)
    ceiling = make_ceiling(DiskBackend(), weights, 1, str(tmp_path), bucket_bytes=1 << 20)
    try:
        sizes = [len(c) for c in ceiling.chunks]
        assert sizes == [1 << 20] * 4, f"disk ceiling at 1 MiB shards wrote files of {sizes}"
    finally:
        ceiling.close()


@pytest.mark.multiproc
def test_bucket_bytes_reach_the_sender_the_ceiling_and_the_row(tmp_path):
    unit = 512 << 10
    backend = BroadcastBackend()  # its own unit: 1 MiB
    with SyncBench(backend, 2 << 20, 1, str(tmp_path), repeats=1, bucket_bytes=unit, n_tensors=16) as bench:
        assert len(bench.weights) == 16, f"n_tensors=16 gave {len(bench.weights)} tensors"
        sent_at = bench.deployment.sender.bucket_bytes
        assert sent_at == unit, f"deployed with bucket_bytes={sent_at}, asked for {unit}"
        plan = list(Manifest.build(0, bench.weights, unit).bucket_sizes)
        own = list(Manifest.build(0, bench.weights, backend.bucket_bytes).bucket_sizes)
        assert plan != own, f"the test payload does not tell the plans apart: {plan}"
        ceiling = [b.numel() for b in bench.ceiling.bufs]
        assert ceiling == plan, f"the ceiling broadcasts {ceiling}, the path's plan at {unit} is {plan}"
        args, _ = bench.before()
        bench.push(*args)
        row = bench.row()
    assert row.bucket_bytes == unit, f"row.bucket_bytes={row.bucket_bytes}, expected {unit}"
    assert row.to_json()["bucket_bytes"] == unit, row.to_json()
    assert row.wrong == 0, f"{row.wrong} tensor(s) wrong at {unit}-byte buckets"


def _row(path: str, rx: int, time_s: float, bucket_bytes: int | None = None) -> SyncRow:
    return SyncRow(path, rx, 64 << 20, 64, "bf16", time_s, 1.0, 2.0, 0, bucket_bytes=bucket_bytes)


def test_report_keeps_sweep_rows_out_of_the_other_tables(tmp_path):
    rows = [
        _row("broadcast", 1, 0.050),
        _row("broadcast", 2, 0.100),
        _row("broadcast", 1, 0.777, bucket_bytes=16 << 20),
        _row("broadcast", 1, 0.888, bucket_bytes=64 << 20),
    ]
    text = write_perf_report(tmp_path, rows, "weightsync bench").read_text()
    head, sep, sweep = text.partition("## Time against bucket size")
    assert sep, f"no bucket section in report.md:\n{text}"
    assert "777.0" not in head and "888.0" not in head, f"sweep rows leaked into the other tables:\n{head}"
    assert "| broadcast | 64 | 50.0 | 100.0 | 2.00 |" in head, f"receivers table changed:\n{head}"
    line = "| broadcast | 1 | 64 | 64 | 777.0 (0.50) | 888.0 (0.50) | 16 MiB |"
    assert line in sweep, f"bucket table lacks {line!r}:\n{sweep}"
    assert (tmp_path / "buckets.png").exists(), sorted(p.name for p in tmp_path.iterdir())


def test_results_json_without_bucket_bytes_still_loads(tmp_path):
    write_perf_report(tmp_path, [_row("disk", 1, 0.05)], "weightsync bench")
    results = tmp_path / "results.json"
    data = json.loads(results.read_text())
    assert data["rows"][0]["bucket_bytes"] is None, data["rows"][0]
    for r in data["rows"]:  # as written before the field existed
        del r["bucket_bytes"]
    results.write_text(json.dumps(data))
    rows, _ = rows_from_results(results)
    assert [r.bucket_bytes for r in rows] == [None], rows


@pytest.mark.multiproc
def test_bench_cli_sweeps_bucket_sizes(tmp_path):
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--backend", "broadcast", "--sizes-mib", "4"]
    cmd += ["--receivers", "1", "--repeats", "2", "--bucket-mib", "1", "4", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-2500:]}"
    (out,) = tmp_path.glob("bench-*")
    report = (out / "report.md").read_text()
    _, sep, sweep = report.partition("## Time against bucket size")
    assert sep, f"no bucket section in report.md:\n{report[-2500:]}"
    for head in ("1 MiB: ms (ratio)", "4 MiB: ms (ratio)"):
        assert head in sweep, f"bucket table lacks the column {head!r}:\n{sweep}"
    assert (out / "buckets.png").exists(), sorted(p.name for p in out.iterdir())
    rows = json.loads((out / "results.json").read_text())["rows"]
    swept = sorted(r["bucket_bytes"] for r in rows if r["bucket_bytes"])
    assert swept == [1 << 20, 4 << 20], f"results.json rows carry bucket_bytes {swept}"
    tensors = {r["count"] for r in rows if r["bucket_bytes"]}
    assert tensors == {8}, f"the sweep's payload of 4 MiB should be at least 8 tensors, got {tensors}"


def test_bench_refuses_a_bucket_size_that_is_not_positive(tmp_path):
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--backend", "broadcast", "--bucket-mib", "16", "0"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, f"exit {proc.returncode}, expected 2 (usage):\n{proc.stderr[-1500:]}"
    assert "--bucket-mib" in proc.stderr, f"the error does not name the option:\n{proc.stderr[-1500:]}"
    assert not any(tmp_path.iterdir()), f"a usage error left {sorted(p.name for p in tmp_path.iterdir())}"
