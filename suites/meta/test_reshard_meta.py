"""Meta tests: the reshard suite (suites/conformance/test_reshard.py) must fail a plan whose slice offset
is off by one row, in process and over gloo (on every engine replica, on either data plane), and a planner that puts replicated kv heads on the wrong TP
ranks (round robin instead of vLLM's blocks), which only TP 4 and up can show."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fixtures.reshard_shapes import head_choices
from harness.reshard.layout import ModelShape, engine_layout, full_weights, trainer_layout
from harness.reshard.plan import build_plan
from harness.reshard.sync import chunk_locals, simulate
from harness.reshard.world import ReshardWorld, job
from suites.conformance.test_reshard import PLANNER_ENV, shard_problems
from suites.meta.broken_reshard import kv_heads_round_robin_planner, off_by_one_row
from suites.meta.warm_pytest import runpytest_warm

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


@pytest.mark.multiproc
@pytest.mark.parametrize("plane", ["p2p", "broadcast"])
def test_every_replica_is_judged_on_either_data_plane(plane):
    """The same broken plan carried to 2 engine replicas: every replica's copy of the shifted shard is
    named (a check that judged replica 0 only, or a plane that left replica 1 out, would not name both)."""
    broken, moved = _broken_plan()
    with ReshardWorld(3, 2, replicas=2) as world:
        run = world.run(job(MODEL, steps=1, plan=broken, plane=plane))
    assert not run.ok and run.plane == plane, f"{plane}: a sync whose plan moved {moved.describe()} passed"
    for q in (0, 1):
        wrong = [
            p
            for p in run.problems()
            if p.startswith(f"engine rank {moved.dst} of replica {q} step 0: {moved.dest}")
        ]
        assert wrong and "first at flat index" in wrong[0], (
            f"{plane}: replica {q}'s {moved.dest} on engine rank {moved.dst} not named:\n{run.summary()}"
        )


def test_suite_fails_an_off_by_one_row_planner(pytester, monkeypatch):
    monkeypatch.setenv(PLANNER_ENV, "suites.meta.broken_reshard:off_by_one_row_planner")
    # this checkout's harness, fixtures and suites, whatever else is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    suite = ROOT / "suites" / "conformance" / "test_reshard.py"
    result = runpytest_warm(pytester, str(suite), "-p", "no:cacheprovider", "-k", "plan_fills")
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


KV_PLANNER = "suites.meta.broken_reshard:kv_heads_round_robin_planner"


def _kv_model(m: int, heads: int, kv_heads: int) -> ModelShape:
    return ModelShape(vocab=40, hidden=5, heads=heads, kv_heads=kv_heads, head_dim=2, intermediate=2 * m)


def test_tp_1_and_2_cannot_tell_round_robin_kv_heads_from_vllms_blocks():
    """Why the suite draws TP 4 and 8: at TP 1 and 2 the round-robin planner's plan is the reference's,
    byte for byte, for every head layout the suite draws; at TP 4 with 2 kv heads it is not."""
    for m in (1, 2):
        for heads, kv in head_choices(m):
            model = _kv_model(m, heads, kv)
            layouts = (trainer_layout(model, 3, "bfloat16"), engine_layout(model, m))
            assert kv_heads_round_robin_planner(*layouts) == build_plan(*layouts), (
                f"TP {m}, {heads} heads, {kv} kv heads: the round-robin planner differs from the reference"
            )
    layouts = (trainer_layout(_kv_model(4, 4, 2), 3, "bfloat16"), engine_layout(_kv_model(4, 4, 2), 4))
    assert kv_heads_round_robin_planner(*layouts) != build_plan(*layouts), (
        "TP 4 with 2 kv heads: the round-robin planner made the reference's plan"
    )


def _suite(pytester, monkeypatch, planner: str | None, select: str):
    if planner:
        monkeypatch.setenv(PLANNER_ENV, planner)
    else:
        monkeypatch.delenv(PLANNER_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    suite = ROOT / "suites" / "conformance" / "test_reshard.py"
    return runpytest_warm(pytester, str(suite), "-p", "no:cacheprovider", "-p", "no:randomly", "-k", select)


@pytest.mark.multiproc
def test_drawn_properties_fail_replicated_kv_heads_on_the_wrong_rank_and_pass_the_reference(
    pytester, monkeypatch
):
    """The drawn bitwise property (in process) and the 3 -> 4 gloo sync of 2 kv heads fail the round-robin
    planner, naming qkv_proj on the swapped ranks; the bytes property passes it (every rank gets the
    right number of bytes, the wrong ones); the reference passes the same drawn properties."""
    select = "plan_fills_every or plan_moves_each or (edge_shards and tp4)"
    broken = _suite(pytester, monkeypatch, KV_PLANNER, select)
    outcomes = broken.parseoutcomes()
    assert (outcomes.get("failed", 0), outcomes.get("passed", 0)) == (3, 1), broken.stdout.str()[-4000:]
    broken.stdout.fnmatch_lines(
        [
            "*FAILED*test_plan_fills_every_engine_shard_bit_for_bit*",
            "*FAILED*test_sync_over_gloo_fills_edge_shards_bit_for_bit*tp4-kv2*",
        ]
    )
    broken.stdout.re_match_lines([r".*\(kv heads fewer than TP ranks\): \d+ engine shard\(s\) wrong.*"])
    broken.stdout.re_match_lines(
        [r".*engine rank [12]: model\.layers\.\d+\.self_attn\.qkv_proj\.(weight|bias).*differ.*"]
    )
    reference = _suite(pytester, monkeypatch, None, "plan_fills_every or plan_moves_each")
    outcomes = reference.parseoutcomes()
    assert (outcomes.get("failed", 0), outcomes.get("passed", 0)) == (0, 2), reference.stdout.str()[-3000:]
