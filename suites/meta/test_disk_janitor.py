"""The disk path deletes retired versions in the background (harness.paths.disk.Janitor): the trainer's
prepare() never waits for an unlink, and once the janitor settles only `keep_versions` remain."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from harness.paths import disk
from harness.paths.disk import DiskSender


def _versions(root) -> list[str]:
    return sorted(p.name for p in root.glob("run-*/v*"))


def test_prepare_does_not_wait_for_the_deletion_of_retired_versions(monkeypatch, tmp_path):
    release, started = threading.Event(), threading.Event()
    real_rmtree = disk.shutil.rmtree
    janitors: list[threading.Thread] = []  # this sender's janitor threads (not another test's)

    def held_rmtree(path, ignore_errors=False):
        # only this test's versions, only on the janitor: the writer's own cleanup is not held
        if threading.current_thread().name == "disk-janitor" and tmp_path in Path(path).parents:
            janitors.append(threading.current_thread())
            started.set()
            assert release.wait(60), "the test never released the janitor"
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(disk.shutil, "rmtree", held_rmtree)
    sender = DiskSender(tmp_path, keep_versions=2)
    sender.init()
    weights = {"w": torch.arange(1000, dtype=torch.float32)}
    for version in range(1, 6):
        sender.prepare(version, weights)  # would block from version 3 on if it deleted in line
    assert started.wait(60), "no retired version was handed to the janitor"
    written = _versions(tmp_path)
    assert len(written) == 5, f"deletions ran while held: {written}"
    release.set()
    sender.settle()
    kept = _versions(tmp_path)
    assert [name.split(".")[0] for name in kept] == ["v0000000004", "v0000000005"], kept
    assert not [t for t in janitors if t.is_alive()], "the janitor thread lingers after settle()"
