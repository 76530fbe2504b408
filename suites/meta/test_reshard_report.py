"""report.md and report.html print the resharding plan test_reshard attaches to its results record in their
appendix: bytes per rank against the plan's minimum (a rank that moved more than its minimum is flagged),
and link reshard-plan.md, which holds every transfer. Synthetic results, nothing runs (seconds)."""

from __future__ import annotations

import json

import pytest

from harness.report import write_report
from harness.reshard.layout import ModelShape, engine_layout, trainer_layout
from harness.reshard.plan import build_plan

pytestmark = pytest.mark.meta

NODE = "suites/conformance/test_reshard.py::test_sync_moves_the_plans_minimum_bytes_per_rank"


def _plan():
    model = ModelShape(vocab=70, hidden=10, heads=2, kv_heads=1, head_dim=4, intermediate=6, qkv_bias=True)
    return build_plan(trainer_layout(model, 3, "bfloat16"), engine_layout(model, 2))


def _results(record: dict) -> dict:
    tests = {NODE: {"status": "passed", "reshard_plan": record}}
    return {
        "broadcast": {
            "backend": "broadcast",
            "engine": "x:y",
            "complete": True,
            "exitstatus": 0,
            "tests": tests,
        }
    }


def test_report_prints_the_plan_and_bytes_per_rank_against_the_minimum(tmp_path):
    plan = _plan()
    measured = plan.bytes_per_rank()
    write_report(
        tmp_path, _results(plan.report_record(measured)), [], "weightsync certify --backend broadcast"
    )
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    transfers = (tmp_path / "reshard-plan.md").read_text()
    minimum = plan.minimum_bytes()
    assert "## Appendix B: resharding plan" in md and ">Appendix B: resharding plan</h2>" in page, md
    assert "[reshard-plan.md](reshard-plan.md)" in md and 'href="reshard-plan.md"' in page, md
    for e in range(2):
        m = minimum[f"engine {e}"]
        row = f"| engine {e} | {m} | {m} | {m} | ok |"
        assert row in md, f"expected the bytes row {row!r} in report.md:\n{md}"
        assert f"<td>engine {e}</td><td class=num>{m}</td>" in page, f"engine {e}'s {m} B not in report.html"
    total = minimum["total"]
    assert f"| total | {total} | {total} | {total} | ok |" in md, md
    t = plan.transfers[-1]
    last = f"| {len(plan.transfers) - 1} | {t.src} | {t.dst} | {t.source} |"
    assert last in transfers, f"the last transfer's row {last!r} is not in reshard-plan.md"
    assert sum(
        line.startswith("| ") and line.split("|")[1].strip().isdigit() for line in transfers.splitlines()
    ) == len(plan.transfers), "reshard-plan.md should have one row per transfer"
    assert last not in md, "the transfers belong in reshard-plan.md, not in report.md"
    assert "tied: `lm_head.weight` is `model.embed_tokens.weight`" in md, md
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["conformance"]["broadcast"]["tests"][NODE]["reshard_plan"]["bytes"][-1]["minimum"] == total


def test_report_flags_a_rank_that_moved_more_than_its_minimum(tmp_path):
    plan = _plan()
    measured = plan.bytes_per_rank() | {"engine 1": plan.minimum_bytes()["engine 1"] + 16}
    write_report(tmp_path, _results(plan.report_record(measured)), [], "weightsync certify")
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "off by +16 B" in md and '<td class="fail">off by +16 B</td>' in page, md


def test_report_has_no_resharding_section_without_a_plan(tmp_path):
    results = _results({})
    results["broadcast"]["tests"][NODE].pop("reshard_plan")
    write_report(tmp_path, results, [], "weightsync certify")
    assert "resharding plan" not in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "reshard-plan.md").exists()
