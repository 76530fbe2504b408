"""The GPU's throughput gate, judged on the CPU (CI has no GPU): which ceiling a path is measured against,
which floor its rows take, and that `--device` reaches the backends and the engines. The 2026-12-03 bug
this guards: on an H200, CUDA IPC at 0.04 of a *host* memcpy ceiling was called `ok` (the CPU floor 0.02)."""

from __future__ import annotations

import pytest

from harness import bench, ceilings
from harness.api import Backend, BackendError, Capabilities
from harness.backends.broadcast import make_nccl_backend
from harness.backends.delta import make_cuda_ipc_backend
from harness.backends.delta import make_nccl_backend as make_delta_nccl_backend
from harness.backends.ipc import make_backend, make_cuda_backend
from harness.devices import DEVICE_ENV, normalize
from harness.registry import make_engine, resolve_backend

pytestmark = pytest.mark.meta

MIB = 1 << 20


def _row(ratio: float, size: int, kind: str, floors) -> bench.SyncRow:
    ceiling = 100.0
    return bench.SyncRow(
        "ipc", 1, size, 8, "bf16", 0.01, ratio * ceiling, ceiling, 0,
        floor=bench.floor_for("ipc", size, floors, kind), ceiling_kind=kind,
    )  # fmt: skip


@pytest.mark.parametrize("size", [64 * MIB, 256 * MIB, 1024 * MIB])
def test_a_gpu_row_at_004_of_a_device_copy_fails(size):
    """With no floor named (the CPU defaults in force, as `weightsync bench --device cuda` starts), a GPU
    row takes the GPU tiers, never the CPU floor of its path's name."""
    row = _row(0.04, size, "device-copy", bench.parse_floors([], bench.CPU_FLOORS))
    expected = 0.90 if size >= 256 * MIB else 0.5
    assert row.floor == expected, (
        f"{size >> 20} MiB against a device copy: floor {row.floor}, expected {expected}"
    )
    assert (row.verdict, row.passed) == ("below floor", False), (row.verdict, row.passed)
    assert bench.gate_failures([row]) == [f"ipc 1rx {size}: below floor"]


def test_gpu_tiers_pass_a_row_at_or_above_them_and_cpu_rows_keep_cpu_floors():
    defaults = bench.parse_floors([], bench.CPU_FLOORS)
    assert _row(0.91, 256 * MIB, "device-copy", defaults).passed
    assert _row(0.55, 64 * MIB, "nccl", defaults).passed
    assert not _row(0.45, 64 * MIB, "p2p-copy", defaults).passed
    cpu = _row(0.04, 256 * MIB, "memcpy", defaults)
    assert (cpu.floor, cpu.passed) == (bench.CPU_FLOORS["ipc"], True), (cpu.floor, cpu.passed)
    assert _row(0.04, 16 * MIB, "device-copy", defaults).floor == 0.0, "rows under 64 MiB are not gated"


def test_a_floor_named_on_the_command_line_replaces_the_gpu_tiers():
    floors = bench.parse_floors(["ipc=0.3"], bench.CPU_FLOORS)
    assert _row(0.04, 256 * MIB, "device-copy", floors).floor == 0.3
    assert bench.floor_for("delta-ipc", 256 * MIB, floors, "device-copy") == 0.90, (
        "another path keeps the tiers"
    )


def test_the_report_names_the_ceiling_each_row_used():
    row = _row(0.5, 256 * MIB, "device-copy", bench.CPU_FLOORS)
    cells = dict(zip(bench.THROUGHPUT_COLUMNS, bench.throughput_cells(row), strict=True))
    assert (cells["bound"], cells["floor"]) == ("device-copy", "0.9"), cells
    assert row.to_json()["ceiling_kind"] == "device-copy"


@pytest.mark.parametrize(
    "backend, kind",
    [
        (make_backend(), "memcpy"),
        (make_cuda_backend(), "device-copy"),
        (make_cuda_ipc_backend(), "device-copy"),
        (make_nccl_backend(), "nccl"),
        (make_delta_nccl_backend(), "nccl"),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_backends_declare_the_transport_that_bounds_them(backend, kind):
    assert ceilings.ceiling_kind(backend) == kind


class _Declares(Backend):
    name = "vendor"
    capabilities = Capabilities()

    def __init__(self, ceiling):
        self.ceiling = ceiling

    def deploy(self, *args, **kwargs):
        raise NotImplementedError


def test_a_declared_ceiling_is_the_one_used_and_an_unknown_one_is_refused():
    assert ceilings.ceiling_kind(_Declares("p2p-copy")) == "p2p-copy"
    with pytest.raises(ValueError, match="declares ceiling 'warp-drive'"):
        ceilings.ceiling_kind(_Declares("warp-drive"))


def test_device_selects_the_gpu_variant_of_a_built_in_backend():
    """No CUDA is touched: building a backend only records where it will run."""
    ipc = resolve_backend("ipc", device="cuda")
    assert (ipc.device, ipc.capabilities.gpu, ipc.ceiling) == ("cuda:0", True, "device-copy")
    assert resolve_backend("broadcast", device="cuda:0").backend == "nccl"
    assert resolve_backend("delta-ipc", device="cuda:0").capabilities.gpu
    assert resolve_backend("ipc", device="cpu").device == "cpu"
    with pytest.raises(BackendError, match="no GPU variant"):
        resolve_backend("disk", device="cuda:0")


def test_the_run_device_reaches_engine_factories(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    engine = make_engine("reference", None)
    try:
        assert str(engine.device) == "cpu"
    finally:
        engine.shutdown()
    assert normalize("cuda") == "cuda:0" and normalize(None) == "cpu"


def _cpu_only_factory(spec=None):
    raise AssertionError("must not be called for a GPU")


def test_an_engine_factory_without_a_device_argument_is_refused_on_a_gpu(monkeypatch):
    import sys
    import types

    module = types.ModuleType("cpu_only_engines")
    module.make = _cpu_only_factory
    monkeypatch.setitem(sys.modules, "cpu_only_engines", module)
    with pytest.raises(BackendError, match="cannot be placed on cuda:0: its factory takes no 'device'"):
        make_engine("cpu_only_engines:make", None, device="cuda:0")


def test_a_backend_that_declares_no_ceiling_has_none_whatever_its_name():
    """The ceiling is what a backend declares (harness.ceilings): a name like a built-in's is no declaration."""
    undeclared = _Declares(None)
    undeclared.name = "broadcast"
    assert ceilings.ceiling_kind(undeclared) is None
