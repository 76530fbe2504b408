"""One cell of the fault matrix, whatever its kind: the trainer's own death runs the trainer in a child
process (harness.faults.trainer_kill), a fault of the network its ranks in containers
(harness.faults.network_cell), every other kind harness.faults.cell's cell. The kind's `family`
says which, so the matrix's suite and certify treat every kind of harness.faults.kinds alike."""

from __future__ import annotations

from pathlib import Path

from harness.api import Backend, Capabilities
from harness.faults.cell import CellResult, run_cell
from harness.faults.injectors import TRAINER_PROCESS
from harness.faults.kinds import FAULTS
from harness.faults.network import NETWORK
from harness.faults.network_cell import run_network_cell
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
    docker_host=None,
) -> CellResult:
    """Run fault `kind` against `backend` at `point` (None: the seed draws one) and judge the cell. A fault
    of the network runs with its ranks in containers of `docker_host` (harness.faults.docker_net)."""
    if FAULTS[kind].family == TRAINER_PROCESS:
        return run_trainer_kill_cell(backend_name, seed, workdir, engine, timeout_s, point)
    if FAULTS[kind].family == NETWORK:
        if docker_host is None:
            why = "a fault of the network needs a Docker host (.ci/docker-tier.sh)"
            return CellResult(backend_name, kind, seed, "unknown", [why])
        return run_network_cell(backend, backend_name, FAULTS[kind](), workdir, timeout_s, docker_host)
    return run_cell(
        backend, backend_name, kind, seed, workdir, engine=engine, timeout_s=timeout_s, caps=caps, point=point
    )
