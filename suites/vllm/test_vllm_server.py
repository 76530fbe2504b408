"""The dev-mode server's own view of a sync: /weight_info moves only when an update finishes, and
the routes a trainer calls answer with errors it can act on."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from harness.api import ManifestMismatch
from harness.deployment import push

from .helpers import engine_of, fresh_weights, next_version, rerun

pytestmark = pytest.mark.vllm


def _weight_info(engine) -> str:
    return engine.call("GET", "/weight_info").json()["weight_version"]


def test_weight_info_reports_the_committed_version(server_llama, request):
    engine = engine_of(server_llama)
    receiver = server_llama.handles[0].receiver
    v0 = engine.weight_version
    v1 = v0 + 1
    receiver.start_weight_update()
    receiver.update_weights(server_llama.sender.prepare(v1, fresh_weights(server_llama)))
    during = _weight_info(engine)
    receiver.finish_weight_update(v1)
    after = _weight_info(engine)
    assert (during, after) == (str(v0) if v0 else "default", str(v1)), (
        f"/weight_info during the update {during!r}, after finish {after!r}; expected it to move from "
        f"{v0} to {v1} only at finish_weight_update\nrerun: {rerun(request)}"
    )


def test_weight_info_stays_after_a_refused_update(server_llama, request):
    engine = engine_of(server_llama)
    before = _weight_info(engine)
    bad = fresh_weights(server_llama)
    bad["model.norm.weight"] = bad["model.norm.weight"][:7].clone()
    with pytest.raises(ManifestMismatch):
        push(server_llama, next_version(server_llama), bad)
    assert _weight_info(engine) == before, (
        f"/weight_info moved to {_weight_info(engine)!r} after a refused update"
    )


def test_vllm_builds_the_harness_transport_through_its_factory(server_llama):
    server = engine_of(server_llama).server
    assert server.alive, f"vLLM server pid {server.proc.pid} is not running; log:\n{server.log_tail()}"
    log = server.log_path.read_text(errors="replace")
    assert "Creating weight transfer engine: FilesWeightTransferEngine" in log, (
        f"{server.log_path} does not show vLLM's WeightTransferEngineFactory creating the harness transport; "
        f"tail:\n{server.log_tail()}"
    )


def test_on_a_small_host_the_engine_core_leaves_the_last_cpu_to_the_api_server(server_llama):
    """harness/engines/vllm_cores.py: the engine core's spin-wait goes to the worker's CPUs, so a control
    call made while tokens stream is answered at once (measured there)."""
    from harness.engines.vllm_cores import engine_core_cpus, engine_processes
    from harness.procs import tasks

    cpus = engine_core_cpus()
    if cpus is None:
        pytest.skip(f"{len(os.sched_getaffinity(0))} CPUs: vLLM's own placement is kept")
    server = engine_of(server_llama).server
    found = {
        f"{name} (pid {pid})": {tid: os.sched_getaffinity(tid) for tid in tasks(pid)}
        for pid, name in engine_processes(server.proc.pid).items()
    }
    assert len(found) == 2, (
        f"expected vLLM's engine core and worker under pid {server.proc.pid}, found {found}"
    )
    wrong = {p: {t: sorted(c) for t, c in threads.items() if c != cpus} for p, threads in found.items()}
    assert not any(wrong.values()), (
        f"threads not on the worker's CPUs {sorted(cpus)} (the last left to the API server): {wrong}"
    )
