"""Meta tests (issue 38, items 1-3): broken senders that the suites passed, each run with the reference
beside it in one pytest run: the broken one fails its target, naming why; the reference passes.

- an ipc sender that deletes the file that took its segment's name (shm-replaced: the foreign file
  is checked, byte for byte, after the faulty push and after the recovery);
- a disk sender that writes through the newest directory it listed, whose error is the writer's stock
  phrase (checkpoints-removed: "names what was damaged" means the directory, not "No such file");
- a delta sender whose reset_base() does nothing (test_supervision pushes consecutive trainer steps,
  so the push after a restart is a patch unless the base was forgotten).
"""

from __future__ import annotations

import pytest
import torch

from harness.api import TransferError
from harness.checks import CellObservation, judge_cell
from harness.faults.injectors import ForeignFile
from suites.meta.warm_pytest import runpytest_warm

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.meta  # the suites run against broken implementations: a tier of its own


def _faults(pytester, backends: str, k: str):
    return runpytest_warm(
        pytester,
        "--pyargs",
        "suites.faults",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        f"--weightsync-backend={backends}",
        "-k",
        k,
    )


def _outcomes(result) -> tuple[int, int]:
    outcomes = result.parseoutcomes()
    return outcomes.get("failed", 0), outcomes.get("passed", 0)


def test_shm_replaced_fails_an_ipc_sender_that_deletes_the_file_that_took_its_name(pytester):
    broken = "suites.meta.broken_damage:make_name_reclaiming_ipc_backend"
    result = _faults(pytester, f"ipc,{broken}", "fault_cell and shm-replaced")
    assert _outcomes(result) == (1, 1), result.stdout.str()[
        -3000:
    ]  # the reference passes, the broken one not
    result.stdout.fnmatch_lines(
        [
            f"*fault cell {broken} x shm-replaced*",
            "*after the faulty push: another process's file /dev/shm/wsync-* was replaced by inode *"
            "the trainer took a name held by a file that is not its own*",
        ]
    )


def test_checkpoints_removed_wants_the_directory_named_not_the_writers_stock_phrase(pytester):
    broken = "suites.meta.broken_damage:make_listing_disk_backend"
    result = _faults(pytester, f"disk,{broken}", "fault_cell and checkpoints-removed")
    assert _outcomes(result) == (1, 1), result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(
        [
            f"*fault cell {broken} x checkpoints-removed*",
            "*the error does not say what was damaged (none of *v0000000001.*): *"
            "writing version 2 failed: No such file or directory; nothing was published*",
        ]
    )


def test_supervision_fails_a_delta_sender_that_ignores_reset_base(pytester):
    broken = "suites.meta.broken:make_base_keeping_delta_backend"
    result = runpytest_warm(
        pytester,
        "--pyargs",
        "suites.conformance",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        f"--weightsync-backend=delta,{broken}",
        "-k",
        "test_rank_killed_between_syncs_is_restarted_by_the_next_push",
    )
    assert _outcomes(result) == (1, 1), result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(
        [
            f"*test_rank_killed_between_syncs_is_restarted_by_the_next_push*{broken}*",
            "*BaseMismatch: version 2: patch made against version 1, engine holds version 0*",
        ]
    )


class _Removed:
    kind = "checkpoints-removed"


def _judged(error: str, must_name: tuple[str, ...]) -> list[str]:
    v1 = {"w": torch.zeros(4)}
    obs = CellObservation(
        fault=_Removed(),
        timeout_s=4.0,
        versions={1: v1, 3: v1},
        error=TransferError(error),
        after_fault=[(1, v1)],
        after_recovery=[(3, v1)],
        must_name=must_name,
    )
    return judge_cell(obs)[1]


def test_a_stock_phrase_does_not_name_what_was_damaged():
    """A backend whose error says only what every failed write says fails "names what was damaged",
    whatever words the kind also accepts; one naming the directory passes it."""
    must_name = ("removed", "missing", "v0000000001.0001")
    stock = _judged(
        "writing version 2 failed: No such file or directory; nothing was published and the partial "
        "files were removed",
        must_name,
    )
    assert len(stock) == 1 and "does not say what was damaged" in stock[0], stock
    assert "'removed'" not in stock[0], f"a stock phrase is still offered as a name: {stock[0]}"
    assert _judged("checkpoint run-0000/v0000000001.0001 was removed by another process", must_name) == []


def test_a_foreign_file_is_checked_byte_for_byte(tmp_path):
    path = tmp_path / "another-process"
    path.write_bytes(b"x" * 4096)
    foreign = ForeignFile.of(path)
    assert foreign.problems("now") == []
    with open(path, "r+b") as f:  # same inode, same size, one byte changed
        f.seek(2048)
        f.write(b"y")
    assert ["the bytes differ" in p and str(path) in p for p in foreign.problems("now")] == [True]
    other = tmp_path / "its-replacement"
    other.write_bytes(foreign.path.read_bytes())
    other.rename(path)  # the same bytes under the name, but another file
    assert ["was replaced by inode" in p for p in foreign.problems("now")] == [True]
    path.unlink()
    assert ["is gone" in p for p in foreign.problems("now")] == [True]
