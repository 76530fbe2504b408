"""`weightsync cost`: the arithmetic (GPU-hours, Gb/s, what fits), reading a results.json, the command line.
Seconds, nothing runs: results files are synthetic (SyncRow.to_json, as certify and bench write them) or the
committed GPU reference the README's worked examples cite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.bench import SyncRow
from harness.cli import main
from harness.cost import (
    GIB,
    Bill,
    Cluster,
    CostInputError,
    Model,
    fabric_payload_gbs,
    gbps_to_gbs,
    gpu_hours,
    parse_params,
    pick_row,
    plan_placement,
    read_rows,
)

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]
GPU_REFERENCE = ROOT / "reports/reference/gpu-h200x1-20261203/bench-ipc/bench-20261203T093138Z/results.json"


# ---- the arithmetic ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "gpus", "steps"),
    [(0.5, 8, 900), (3.6, 1, 1000), (0.0237, 64, 10_000), (1.56, 10, 1)],
)
def test_gpu_hours_are_seconds_times_gpus_times_steps_over_3600(seconds, gpus, steps):
    assert gpu_hours(seconds, gpus, steps) == seconds * gpus * steps / 3600


def test_gpu_hours_of_round_figures_are_exact():
    assert gpu_hours(0.5, 8, 900) == 1.0  # 0.5 s × 8 GPUs × 900 steps = 3600 GPU-seconds
    assert gpu_hours(3.6, 1, 1000) == 1.0


def test_a_bill_is_per_step_times_steps_and_money_is_hours_times_price():
    bill = Bill("sync", 0.25, "given", gpus=16, steps=2000, price=3.0)
    assert bill.gpu_seconds_per_step == 4.0
    assert bill.gpu_hours_per_run == 0.25 * 16 * 2000 / 3600
    assert bill.money(bill.gpu_hours_per_run) == pytest.approx(bill.gpu_hours_per_run * 3.0)
    assert Bill("sync", 0.25, "given", 16, 2000, price=None).money(1.0) is None, "no price, no money"


def test_a_link_in_gigabits_is_an_eighth_in_gigabytes():
    assert gbps_to_gbs(400) == 50.0, "400 Gb/s NDR is 50 GB/s raw"
    assert gbps_to_gbs(800) == 100.0
    assert fabric_payload_gbs(400, 0.9) == pytest.approx(45.0), "~45 GB/s of NDR's 50 reach the buffers"


@pytest.mark.parametrize(
    ("text", "count"), [("7B", 7e9), ("70b", 70e9), ("1.5T", 1.5e12), ("350M", 350e6), ("7e9", 7e9)]
)
def test_parameter_counts_as_people_write_them(text, count):
    assert parse_params(text) == count


@pytest.mark.parametrize("text", ["7X", "seven", "", "0B"])
def test_a_parameter_count_that_is_not_one_is_refused_by_name(text):
    with pytest.raises(CostInputError, match=f"--params {text!r}"):
        parse_params(text)


# ---- placement --------------------------------------------------------------------------------------------


def _results(plan) -> dict[str, str]:
    return {line.what: line.result for line in plan.lines}


def test_7b_bf16_adam_fits_collocated_on_one_h200():
    plan = plan_placement(Model(7e9), Cluster(gpu_mem_gib=139, kv_gib=16, same_gpu_gbs=590.1))
    assert Model(7e9).weights == 14e9 and Model(7e9).trainer_state == 112e9, "2 B and 2 + 2 + 12 B a param"
    # 112e9 / 2**30 + 14e9 / 2**30 + 16 = 104.31 + 13.04 + 16 = 133.35 GiB ≤ 139
    assert _results(plan)["one GPU, collocated"] == "fits (133.35 ≤ 139 GiB)", plan.lines
    assert (plan.collocated.gpus, plan.disaggregated.gpus) == (1, 2)
    assert plan.collocated.sync_s == pytest.approx(14e9 / 590.1e9)
    assert plan.disaggregated.sync_s == pytest.approx(14e9 / 45e9), "W over one 400 Gb/s link at 45 GB/s"
    assert plan.advice.startswith("collocated: it holds 1 GPU against 2"), plan.advice


def test_70b_does_not_fit_collocated_on_the_trainers_gpus_and_says_so():
    plan = plan_placement(Model(70e9), Cluster(gpu_mem_gib=139, kv_gib=16, links=8))
    results = _results(plan)
    for line in ("one GPU, collocated", "one GPU, disaggregated trainer", "one GPU, disaggregated engine"):
        assert results[line].startswith("DOES NOT FIT"), f"{line}: {results[line]}"
    # T = 1120e9 B = 1043.08 GiB: ceil(1043.08 / 139) = 8 trainer GPUs; (T + W) / 8 + 16 = 162.68 GiB > 139
    assert results["trainer GPUs N_t (fully sharded)"] == "8"
    assert results["collocated on the trainer's 8 GPUs"] == "DOES NOT FIT (162.68 > 139 GiB)"
    assert results["collocated GPUs N_c"] == "10", "ceil(1173.47 / (139 - 16)) = ceil(9.54)"
    assert results["engine GPUs per replica N_e"] == "2", "ceil(130.39 / 123)"
    assert plan.disaggregated.gpus == 8 + 2
    assert results["links used at once k"] == "2", "8 links, but only 2 engine GPUs to receive"
    assert plan.disaggregated.sync_s == pytest.approx(140e9 / (2 * 45e9))
    assert plan.collocated.sync_s is None, "no same-GPU rate was given: no collocated sync time"


def test_a_kv_budget_bigger_than_the_gpu_fits_nowhere_and_says_so():
    plan = plan_placement(Model(7e9), Cluster(gpu_mem_gib=139, kv_gib=139))
    assert plan.collocated.gpus is None and plan.disaggregated.gpus is None
    assert plan.advice.startswith("Neither placement fits"), plan.advice


def test_a_trainer_given_too_few_gpus_does_not_fit_disaggregated():
    plan = plan_placement(Model(70e9), Cluster(trainer_gpus=4))
    assert _results(plan)["trainer GPUs N_t"].startswith("DOES NOT FIT"), plan.lines
    assert plan.disaggregated.gpus is None
    assert plan.advice == "collocated: the only placement that fits (10 GPUs).", plan.advice


# ---- a results.json ---------------------------------------------------------------------------------------


def _row(path="ipc", size=1 << 30, time_s=0.005, rx=1, changed=0.0, wrong=0, bucket=None) -> dict:
    gbs = size / time_s / 1e9
    row = SyncRow(
        path, rx, size, 8, "bf16", time_s, gbs, gbs * 4, wrong, changed=changed, bucket_bytes=bucket
    )
    return row.to_json()


def _write(tmp_path, rows, key="throughput") -> Path:
    """certify writes its rows under 'throughput', bench under 'rows' (harness/report.py, perf_report.py)."""
    file = tmp_path / "results.json"
    file.write_text(json.dumps({"schema_version": 1, key: rows}))
    return file


@pytest.mark.parametrize("key", ["throughput", "rows"])
def test_the_largest_row_of_the_path_is_billed_from_certify_and_bench_results(tmp_path, key):
    file = _write(tmp_path, [_row(size=64 << 20, time_s=0.004), _row(size=1 << 30, time_s=0.005)], key)
    row = pick_row(read_rows(file), str(file))
    assert (row.size_bytes, row.time_s) == (1 << 30, 0.005)
    assert row.gbs == (1 << 30) / 0.005 / 1e9


def test_bucket_sweep_rows_are_not_billed_and_a_delta_row_at_1_percent_is(tmp_path):
    rows = [
        _row(size=1 << 30, time_s=0.9, bucket=16 << 20),  # a bucket size, not the path as deployed
        _row(size=64 << 20, time_s=0.01),
        _row("delta", 1 << 30, 0.02, changed=0.001),
        _row("delta", 1 << 30, 0.03, changed=0.01),
        _row("delta", 1 << 30, 0.04, changed=0.5),
    ]
    file = _write(tmp_path, rows)
    assert pick_row(read_rows(file), str(file), path="ipc").size_bytes == 64 << 20
    assert pick_row(read_rows(file), str(file), path="delta").changed == 0.01


def test_the_committed_gpu_reference_gives_the_readmes_figures():
    rows = read_rows(GPU_REFERENCE)
    gib = pick_row(rows, str(GPU_REFERENCE), size_mib=1024)
    assert (round(gib.time_s * 1e3, 2), round(gib.gbs, 1)) == (4.76, 225.5)
    largest = pick_row(rows, str(GPU_REFERENCE))
    assert (largest.size_bytes, round(largest.gbs, 1)) == (4 * GIB, 590.1)


@pytest.mark.parametrize(
    ("rows", "kwargs", "says"),
    [
        ([_row(wrong=2)], {}, "#wrong 2"),
        ([_row()], {"path": "disk"}, "--row-path disk"),
        ([_row()], {"size_mib": 3}, "--row-size-mib 3"),
        ([_row()], {"receivers": 4}, "--row-receivers 4"),
        ([_row("ipc"), _row("disk")], {}, "name one with --row-path"),
        ([], {}, "holds no throughput rows"),
        ([{"path": "ipc"}], {}, "row 0 lacks receivers, size_bytes, time_s"),
    ],
    ids=[
        "wrong-bytes",
        "unknown-path",
        "unknown-size",
        "unknown-receivers",
        "two-paths",
        "no-rows",
        "no-time",
    ],
)
def test_a_row_that_cannot_be_billed_is_refused_naming_why(tmp_path, rows, kwargs, says):
    file = _write(tmp_path, rows)
    with pytest.raises(CostInputError) as err:
        pick_row(read_rows(file), str(file), **kwargs)
    assert says in str(err.value), str(err.value)


# ---- the command line ---------------------------------------------------------------------------------------


def test_cost_prints_the_sync_bill_and_its_arithmetic(capsys):
    assert main(["cost", "--sync-s", "0.5", "--gpus", "8", "--steps", "900", "--price", "3"]) == 0
    out = capsys.readouterr().out
    assert "0.5 s × 8 GPUs × 900 steps / 3600 = 1 GPU-hours × $3/GPU-hour = $3.00" in out, out


def test_cost_bills_the_pause_beside_the_sync(capsys):
    args = ["cost", "--sync-s", "0.2", "--pause-s", "0.9", "--gpus", "4", "--steps", "1000"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pause: 0.9 s × 4 GPUs × 1000 steps / 3600 = 1 GPU-hours" in out, out


def test_cost_json_from_the_gpu_reference_with_a_model(capsys):
    args = ["cost", "--results", str(GPU_REFERENCE), "--params", "7B", "--gpus", "8", "--steps", "1000"]
    assert main([*args, "--price", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (sync,) = data["bills"]
    assert sync["seconds_per_step"] == pytest.approx(14e9 / ((4 << 30) / 0.007278305999989243))
    assert sync["gpu_hours_per_run"] == sync["seconds_per_step"] * 8 * 1000 / 3600
    assert sync["money_per_run"] == pytest.approx(sync["gpu_hours_per_run"] * 3)
    assert data["placement"]["collocated"]["gpus"] == 1, data["placement"]["advice"]
    assert data["placement"]["disaggregated"]["sync_s"] == pytest.approx(14e9 / 45e9)


def test_the_weightsync_command_runs_cost_and_prints_the_placement(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "cost",
            "--params",
            "70B",
            "--throughput-gbs",
            "590",
            "--gpus",
            "10",
        ]
        + ["--steps", "1000"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "DOES NOT FIT (162.68 > 139 GiB)" in proc.stdout, proc.stdout[-3000:]
    assert "Advice: collocated" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--sync-s", "-1", "--gpus", "8", "--steps", "10"], "--sync-s -1.0: must be greater than 0"),
        (["--sync-s", "1", "--gpus", "0", "--steps", "10"], "--gpus 0: must be greater than 0"),
        (
            ["--sync-s", "1", "--gpus", "8", "--steps", "10", "--price", "-3"],
            "--price -3.0: must be 0 or more",
        ),
        (["--sync-s", "1", "--gpus", "8"], "--steps is needed to bill 1 s per step"),
        (["--params", "7X"], "--params '7X': not a parameter count"),
        (["--params", "7B", "--fabric-efficiency", "1.5"], "--fabric-efficiency 1.5"),
        (["--throughput-gbs", "45", "--gpus", "8", "--steps", "10"], "--throughput-gbs 45: needs --params"),
        (["--sync-s", "1", "--throughput-gbs", "45"], "--sync-s and --throughput-gbs: give one source"),
        (["--results", "no/such/results.json"], "--results no/such/results.json: no such file"),
        (
            ["--sync-s", "1", "--gpus", "8", "--steps", "10", "--row-path", "ipc"],
            "--row-path ipc: picks a row of --results",
        ),
        ([], "nothing to cost"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_value(capsys, args, says):
    assert main(["cost", *args]) == 2
    captured = capsys.readouterr()
    assert says in captured.err, f"the error does not name the bad input ({says!r}):\n{captured.err}"
    assert captured.out == "", f"a usage error printed figures:\n{captured.out}"


def test_a_value_argparse_cannot_read_is_exit_2_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["cost", "--sync-s", "1", "--gpus", "eight"])
    assert exit_.value.code == 2
    assert "--gpus: invalid int value: 'eight'" in capsys.readouterr().err
