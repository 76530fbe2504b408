"""The GPU's throughput gate, judged on the CPU (CI has no GPU): which ceiling a path is measured against,
and that `--device` reaches the backends and the engines. The 2026-12-03 bug this guards: on an H200, CUDA
IPC at 0.04 of a *host* memcpy ceiling was called `ok` (the CPU floor 0.02). The gate's arithmetic on GPU
figures is suites/meta/test_throughput_model.py."""

from __future__ import annotations

import pytest

from harness import ceilings
from harness.api import Backend, BackendError, Capabilities
from harness.backends.broadcast import make_nccl_backend
from harness.backends.delta import make_cuda_ipc_backend
from harness.backends.delta import make_nccl_backend as make_delta_nccl_backend
from harness.backends.ipc import make_backend, make_cuda_backend
from harness.devices import DEVICE_ENV, normalize
from harness.registry import make_engine, resolve_backend

pytestmark = pytest.mark.meta

MIB = 1 << 20


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
    reshard = resolve_backend("reshard", device="cuda:0")  # named only; every rank on the one GPU
    assert (reshard.device, reshard.capabilities.gpu, reshard.ceiling) == ("cuda:0", True, "device-copy")
    assert resolve_backend("reshard", device="cpu").ceiling == "gloo"
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
