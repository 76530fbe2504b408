"""The fault matrix: every fault kind against every selected path, with the reference engine (or the one
selected; with the default selection the HTTP control plane gets a column too). Each cell pushes version 1 cleanly, pushes version 2 under the fault, heals, pushes version 3,
and is judged (harness.checks.judge_cell): safety (every engine serves one committed version bit for bit),
bounded (the failing push returns within 2x the timeout with a specific error naming the receiver),
agreement (nothing reports success while engines differ), recovery (version 3 everywhere, no redeploy by
hand), nothing leaked. The verdict lands in the results JSON ("fault_cell") for the report.

    pytest suites/faults --weightsync-backend=ipc --weightsync-fault-seeds=20
    pytest suites/faults -k "receiver-kill and disk" --weightsync-fault-seed=1234    # rerun one cell
    pytest suites/faults --weightsync-hypothesis-profile=thorough  # + seeds drawn by hypothesis, 10 per cell

Under the thorough profile hypothesis draws the seeds (`test_fault_cell_drawn`): a failing one is printed
("Falsifying example", in newer hypothesis "Failing test case": ... seed=N, rerun it with --weightsync-fault-seed=N) and kept in hypothesis'
example database, so the next run tries it first. Seeds are not shrunk: a smaller seed is not a simpler fault.
"""

from __future__ import annotations

import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from harness.faults.injectors import SEEDED
from harness.faults.kinds import CONTROL_PLANE_KINDS, FAULTS, NETWORK_KINDS
from harness.faults.matrix import run_matrix_cell
from harness.pytest_plugin import NOT_SUPPORTED, UNKNOWN, outcomes_of, selection_of
from harness.registry import BUILTIN_BACKENDS, EXTRA_BACKENDS, resolve_backend

pytestmark = [pytest.mark.multiproc, pytest.mark.faults]


THOROUGH_DRAWS = 10


def _thorough() -> bool:
    return settings.get_current_profile_name() == "weightsync-thorough"


def _backends(config) -> list[str]:
    option = config.getoption("--weightsync-backend")
    backends = [n.strip() for n in option.split(",") if n.strip()]
    if option == ",".join(BUILTIN_BACKENDS):  # the default selection: the control plane gets its column too
        backends += list(EXTRA_BACKENDS)
    return backends


def _kinds(config, backend: str) -> list[str]:
    implicit = (
        config.getoption("--weightsync-backend") == ",".join(BUILTIN_BACKENDS) and backend in EXTRA_BACKENDS
    )
    # the control column in the default selection runs the faults of the control plane itself (Fault.control_plane):
    # its data plane is the disk path's, whose column runs the rest; `--weightsync-backend=control` (and
    # `weightsync certify`) runs every kind against it
    # the network's kinds need ranks on other hosts: the Docker tier runs them (test_network_docker.py)
    return [k for k in FAULTS if k not in NETWORK_KINDS and (not implicit or k in CONTROL_PLANE_KINDS)]


def _points(config, backend: str, kind: str) -> tuple[str, ...]:
    """The fault's named points for this backend's claimed capabilities (harness.faults.injectors)."""
    sel = selection_of(config)
    caps = (
        sel.capabilities(backend)
        if backend in sel.backends
        else resolve_backend(backend).capabilities.restricted_by(sel.engine_caps)
    )
    return _chosen(config, FAULTS[kind]().points(caps))


def _chosen(config, points: tuple[str, ...]) -> tuple[str, ...]:
    """The points --weightsync-fault-points keeps: all, the first, or those named."""
    option = config.getoption("--weightsync-fault-points")
    if option == "all":
        return points
    if option == "one":
        return points[:1]
    named = {p.strip() for p in option.split(",")}
    return tuple(p for p in points if p in named)


def pytest_generate_tests(metafunc):
    """Every fault at every named point of it, deterministically (the seed then only picks bytes);
    --weightsync-fault-seeds=N adds N cells per fault whose point the seed draws. --weightsync-quick
    keeps each fault's first point at its one seed (the rest are marked not_quick: `_quick`)."""
    config = metafunc.config
    if "fault_cell" in metafunc.fixturenames:
        fixed = config.getoption("--weightsync-fault-seed")
        n_seeds = config.getoption("--weightsync-fault-seeds") or 0
        cells = []
        for backend in _backends(config):
            for kind in _kinds(config, backend):
                base = zlib.crc32(f"{backend}/{kind}".encode()) % 100_000
                seed = fixed if fixed is not None else base
                cells += [(backend, kind, point, seed) for point in _points(config, backend, kind)]
                if fixed is not None and n_seeds == 0:
                    n_seeds = 1  # a rerun by seed: that seed's own point too
                cells += [(backend, kind, SEEDED, seed + i) for i in range(n_seeds)]
        firsts = {(b, k): p for b, k, p, _ in reversed(cells)}  # the first point of each fault
        params = [
            pytest.param(
                c, id="{}-{}-{}-s{}".format(*c), marks=() if _quick(*c, firsts) else pytest.mark.not_quick
            )
            for c in cells
        ]
        metafunc.parametrize("fault_cell", params)
    if "drawn_cell" in metafunc.fixturenames:
        cells = [(b, k) for b in _backends(config) for k in _kinds(config, b)]
        quick = pytest.mark.not_quick if _thorough() else ()  # they skip themselves unless thorough
        metafunc.parametrize(
            "drawn_cell", [pytest.param(c, id="{}-{}".format(*c), marks=quick) for c in cells]
        )


def _quick(backend: str, kind: str, point: str, seed: int, firsts: dict) -> bool:
    """Whether --weightsync-quick runs this cell: its fault's first point, at its one seed; in the control
    plane's column only the control plane's own faults (its data plane is disk's, whose column has the rest)."""
    if backend in EXTRA_BACKENDS and kind not in CONTROL_PLANE_KINDS:
        return False
    return point != SEEDED and firsts[(backend, kind)] == point


def test_fault_cell(fault_cell, weightsync_selection, tmp_path, request):
    backend_name, kind, point, seed = fault_cell
    _run_and_judge(backend_name, kind, seed, weightsync_selection, tmp_path, request, point)


def test_fault_cell_drawn(drawn_cell, weightsync_selection, tmp_path, request):
    """The thorough profile's cells: hypothesis draws the seed (and so the fault point)."""
    if not _thorough():
        pytest.skip("seeds drawn by hypothesis run under --weightsync-hypothesis-profile=thorough")
    backend_name, kind = drawn_cell

    @settings(
        max_examples=config_draws(request.config),
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(seed=st.integers(0, 2**31 - 1))
    def cell(seed):
        _run_and_judge(
            backend_name, kind, seed, weightsync_selection, Path(tempfile.mkdtemp(dir=tmp_path)), request
        )

    cell()


def config_draws(config) -> int:
    return config.getoption("--weightsync-fault-seeds") or THOROUGH_DRAWS


def _run_and_judge(backend_name, kind, seed, selection, tmp_path, request, point=SEEDED):
    backend = selection.backends.get(backend_name) or resolve_backend(backend_name)
    timeout_s = request.config.getoption("--weightsync-fault-timeout")
    caps = backend.capabilities.restricted_by(selection.engine_caps)
    result = run_matrix_cell(
        backend, backend_name, kind, seed, tmp_path, selection.engine, timeout_s, caps, point
    )
    outcome = outcomes_of(request.config).setdefault(request.node.nodeid, {})
    if (
        outcome.get("fault_cell", {}).get("verdict", "ok") == "ok"
    ):  # of several draws the report keeps the worst
        outcome["fault_cell"] = result.to_json()
    rerun = (
        f"pytest 'suites/faults/test_fault_matrix.py' -k '{backend_name}-{kind}-{point}' "
        f"--weightsync-backend={backend_name} --weightsync-fault-seed={seed}"
    )
    if result.verdict == "not_applicable":  # the same for every seed: hypothesis stops here too
        pytest.skip(f"{NOT_SUPPORTED}: {kind} on {backend_name}: {result.reasons[0]}")
    if result.verdict == "unknown":
        pytest.skip(f"{UNKNOWN}: {kind} on {backend_name}: {'; '.join(result.reasons)}")
    assert result.verdict == "ok", (
        f"fault cell {backend_name} x {kind} (seed {seed}, {result.point}, timeout {timeout_s:g}s):\n  "
        + "\n  ".join(result.reasons)
        + f"\nerror of the faulty push: {result.error}\nwhat the nemesis did: {result.log}\nrerun: {rerun}"
        + (f"\nthe cell's stack when its deadline passed:\n{result.stacks[-2000:]}" if result.stacks else "")
    )
