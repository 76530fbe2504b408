"""One cell of the fault matrix, whatever its kind: the trainer's own death runs the trainer in a child
process (harness.faults.trainer_kill), every other kind harness.faults.cell's cell. The kind's `family`
says which, so the matrix's suite and certify treat every kind of harness.faults.kinds alike."""

from __future__ import annotations

from pathlib import Path

from harness.api import Backend, Capabilities
from harness.faults.cell import CellResult, run_cell
from harness.faults.injectors import TRAINER_PROCESS
from harness.faults.kinds import FAULTS
from harness.faults.trainer_kill import run_trainer_kill_cell


def run_matrix_cell(
    backend: Backend,
    backend_name: str,
    kind: str,
    seed: int,
    workdir: Path,
    engine: str | None,
    timeout_s: float,
    caps: Capabilities,
    point: str | None = None,
) -> CellResult:
    """Run fault `kind` against `backend` at `point` (None: the seed draws one) and judge the cell."""
    if FAULTS[kind].family == TRAINER_PROCESS:
        return run_trainer_kill_cell(backend_name, seed, workdir, engine, timeout_s, point)
    return run_cell(
        backend, backend_name, kind, seed, workdir, engine=engine, timeout_s=timeout_s, caps=caps, point=point
    )
