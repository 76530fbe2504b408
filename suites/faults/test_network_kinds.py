"""The network's faults are kinds of the matrix like any other (harness.faults.kinds): each runs through
harness.faults.matrix.run_matrix_cell, and says why it cannot run where it cannot, before anything is
deployed. Their cells themselves need a Docker engine: suites/faults/test_network_docker.py (Docker tier)."""

from __future__ import annotations

import pytest

from harness.backends.ipc import IpcBackend
from harness.faults.injectors import Fault
from harness.faults.kinds import FAULTS, NETWORK_KINDS
from harness.faults.matrix import run_matrix_cell

pytestmark = pytest.mark.faults


def test_every_network_kind_is_a_fault_of_the_one_shape():
    assert set(NETWORK_KINDS) == {
        "net-disconnect", "net-partition", "net-one-way", "net-loss20", "net-bandwidth", "net-oom"
    }  # fmt: skip
    for kind in NETWORK_KINDS:
        fault = FAULTS[kind]()
        assert isinstance(fault, Fault) and fault.points(None) == ("mid-transmit",), kind


def test_a_path_whose_ranks_cannot_be_placed_on_other_hosts_is_not_supported(tmp_path):
    backend = IpcBackend()
    for kind in NETWORK_KINDS:
        result = run_matrix_cell(
            backend, "ipc", kind, 0, tmp_path, None, 4.0, backend.capabilities, docker_host=object()
        )
        assert result.verdict == "not_applicable" and "containers" in result.reasons[0], (kind, result)


def test_without_a_docker_host_a_network_cell_is_unknown_never_passed(tmp_path):
    backend = IpcBackend()
    result = run_matrix_cell(
        backend, "broadcast", "net-partition", 0, tmp_path, None, 4.0, backend.capabilities
    )
    assert result.verdict == "unknown" and "Docker" in result.reasons[0], result
