"""harness.profile_push, where one sync's fixed cost goes: the bare lifecycle timed four ways and profiled in
the trainer and in every rank process (each rank dumps its own profile as it exits)."""

from __future__ import annotations

import json

from harness.profile_push import main


def test_profiles_the_trainer_and_every_rank_of_a_bare_push(tmp_path):
    assert main(["--backend", "ipc", "--receivers", "2", "--pushes", "5", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("after_gc_ms", "warm_ms", "after_gc_frozen_ms", "phases_ms", "profiled_ms"):
        assert summary[key] > 0, (key, summary)
    assert set(summary["steps_ms"]) == {"start", "prepare", "transfer", "finish"}, summary
    assert "commit" in summary["receiver_phases_ms"], summary
    assert "deployment.py" in (tmp_path / "trainer.txt").read_text()
    for rank in (1, 2):  # each rank's own profile: the receiver's lifecycle calls ran there
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert "update_weights" in text and "finish_weight_update" in text, text[:2000]


def test_tensor_bytes_sizes_every_tensor_of_the_pushed_payload(tmp_path):
    # on a GPU whole 16-byte words take the same-GPU path's in-place read; the bare row's 2-byte tensors do not
    args = ["--backend", "ipc", "--pushes", "3", "--tensor-bytes", "4096", "--out", str(tmp_path)]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tensor_bytes"] == [4096], summary
    assert summary["warm_ms"] > 0, summary
