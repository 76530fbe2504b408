"""The whole sync as a trainer pays it, on pytest-benchmark, gated by its ratio to the transport's ceiling.

Each test pushes `repeats` new versions through a fresh deployment of the selected path (start, prepare,
transfer, finish on every engine); before each push, untimed, two repeats of the ceiling (the raw
transport: file write+fsync+reads, bare gloo broadcast, memcpy) run, so ceiling and path see the same
machine. pytest-benchmark times the pushes (its JSON, `--benchmark-save` / `--benchmark-compare`, is
the regression record); the verdict is the ratio gate (harness.bench.SyncRow): #wrong must be 0, the
ratio at or above the path's floor (`--weightsync-floor PATH=RATIO`, defaults in harness.bench.CPU_FLOORS),
and a ratio above 1.0 is UNRELIABLE (skipped with the figures, never passed).

    pytest suites/performance -k sync_throughput --weightsync-backend=ipc --benchmark-save=mine
    pytest suites/performance -m slow -k scaling         # the scaling tables (sizes, receivers)
"""

from __future__ import annotations

import pytest

from harness.bench import SyncBench, floor_for
from harness.pytest_plugin import floors_of

pytestmark = pytest.mark.multiproc

REPEATS = 5


def _paths(config) -> list[str]:
    return [n.strip() for n in config.getoption("--weightsync-backend").split(",") if n.strip()]


def pytest_generate_tests(metafunc):
    if "path_name" in metafunc.fixturenames:  # ids: the path's own name, so saved benchmarks compare across builds
        from harness.registry import resolve_backend

        paths = _paths(metafunc.config)
        metafunc.parametrize("path_name", paths, ids=[resolve_backend(p).name for p in paths])


def _gate(row, benchmark) -> None:
    benchmark.extra_info.update(row.to_json())
    figures = (f"{row.path} {row.receivers} rx {row.size_bytes / 2**20:.0f} MiB: {row.algbw_gbs:.3f} GB/s = "
               f"{row.ratio:.3f} of its ceiling {row.ceiling_gbs:.3f} GB/s (floor {row.floor}); median "
               f"{row.time_s * 1e3:.1f} ms = " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.parts.items()))
    assert row.wrong == 0, f"{row.wrong} tensor(s) differ after the last push: {figures}"
    if row.verdict == "unreliable":
        pytest.skip(f"UNRELIABLE: the path beat its ceiling, which was therefore no ceiling: {figures}")
    assert row.passed, f"below the floor: {figures}"


def _run(benchmark, backend, size, receivers, tmp_path, floor, rounds=REPEATS):
    with SyncBench(backend, size, receivers, str(tmp_path), floor=floor, repeats=rounds) as bench:
        benchmark.pedantic(bench.push, setup=bench.before, rounds=rounds, iterations=1)
        return bench.row()


def test_sync_throughput_against_its_ceiling(benchmark, selection, path_name, tmp_path, pytestconfig):
    backend = selection.backends[path_name]
    size = pytestconfig.getoption("--weightsync-bench-mib") << 20
    row = _run(benchmark, backend, size, 1, tmp_path, floor_for(backend.name, size, floors_of(pytestconfig)))
    _gate(row, benchmark)


@pytest.mark.slow
@pytest.mark.parametrize("size_mib", [16, 64, 256])
@pytest.mark.parametrize("receivers", [1, 2, 3])
def test_sync_scaling(benchmark, selection, path_name, size_mib, receivers, tmp_path, pytestconfig):
    """The scaling table: time against payload size and against receivers (broadcast's should stay flat)."""
    backend = selection.backends[path_name]
    if receivers > 1 and not backend.capabilities.multi_receiver:
        pytest.skip(f"backend {path_name!r} takes one receiver")
    size = size_mib << 20
    row = _run(benchmark, backend, size, receivers, tmp_path, floor_for(backend.name, size, floors_of(pytestconfig)), 3)
    _gate(row, benchmark)
