"""Meta tests: the reshard suite (suites/conformance/test_reshard.py) must fail a plan whose slice offset
is off by one row, in process and over gloo."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.reshard.layout import ModelShape, engine_layout, full_weights, trainer_layout
from harness.reshard.plan import build_plan
from harness.reshard.sync import chunk_locals, simulate
from harness.reshard.world import ReshardWorld, job
from suites.conformance.test_reshard import PLANNER_ENV, shard_problems
from suites.meta.broken_reshard import off_by_one_row

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelShape(vocab=70, hidden=12, heads=2, kv_heads=1, head_dim=4, intermediate=8, qkv_bias=True)


def _broken_plan():
    plan = build_plan(trainer_layout(MODEL, 3, "bfloat16"), engine_layout(MODEL, 2))
    broken, i = off_by_one_row(plan)
    assert broken.transfers[i] != plan.transfers[i], f"the broken planner changed nothing:\n{plan.table()}"
    return broken, broken.transfers[i]


def test_bitwise_property_fails_a_plan_off_by_one_row():
    broken, moved = _broken_plan()
    full = full_weights(MODEL, "bfloat16", seed=3)
    problems = shard_problems(broken, full, simulate(broken, chunk_locals(broken, full)))
    named = [
        p for p in problems if f"engine rank {moved.dst}: {moved.dest}" in p and "first at flat index" in p
    ]
    assert named, f"a plan that moved {moved.describe()} by one row passed the property; problems: {problems}"


@pytest.mark.multiproc
def test_gloo_sync_with_a_plan_off_by_one_row_fails_on_the_shifted_shard():
    broken, moved = _broken_plan()
    with ReshardWorld(3, 2) as world:
        run = world.run(job(MODEL, steps=1, plan=broken))
    assert not run.ok, f"a sync whose plan moved {moved.describe()} by one row passed:\n{run.summary()}"
    wrong = [p for p in run.problems() if p.startswith(f"engine rank {moved.dst} step 0: {moved.dest}")]
    assert wrong and "first at flat index" in wrong[0], (
        f"no problem names {moved.dest} on engine rank {moved.dst}:\n{run.summary()}"
    )


def test_suite_fails_an_off_by_one_row_planner(pytester, monkeypatch):
    monkeypatch.setenv(PLANNER_ENV, "suites.meta.broken_reshard:off_by_one_row_planner")
    # this checkout's harness, fixtures and suites, whatever else is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    suite = ROOT / "suites" / "conformance" / "test_reshard.py"
    result = pytester.runpytest_subprocess(str(suite), "-p", "no:cacheprovider", "-k", "plan_fills")
    assert result.parseoutcomes().get("failed", 0) == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*engine shard(s) wrong*"])


def test_gpu_bench_fails_a_plan_off_by_one_row(tmp_path):
    """gpu_bench (CPU, small) with the off-by-one planner: exit status 1, the shifted shard named."""
    from harness.reshard.gpu_bench import main

    planner = "suites.meta.broken_reshard:off_by_one_row_planner"
    args = ["--device", "cpu", "--small", "--out", str(tmp_path), "--warmup", "0", "--repeats", "1"]
    assert main([*args, "--planner", planner]) == 1, (
        "gpu_bench passed a plan with one transfer off by one row"
    )
    rows = json.loads((tmp_path / "reshard_bench.json").read_text())["rows"]
    caught = [(r["trainers"], r["engines"]) for r in rows[1:] if r["wrong"]]
    assert caught == [(n, m) for n in (1, 2) for m in (1, 2)], (
        f"expected every (N, M) to show a wrong shard, got {caught}: {[r['wrong'][:2] for r in rows]}"
    )
