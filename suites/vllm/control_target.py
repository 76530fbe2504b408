"""Real vLLM as the control server under test: the factory `start` that
`--weightsync-control-server suites.vllm.control_target:start` calls once per test (harness/control/under_test.py).

`start` recycles, as the in-process engine factory does (harness/engines/vllm.py): closing a server puts
its vLLM back to a fresh server's state over its own routes (in-flight requests aborted, awake, not
paused, no update open, the checkpoint pushed back through the transport and read back bit for bit,
label "default", prefix cache empty, the transport's roots forgotten), and the next test is served by it.
A server that cannot be put back for certain is stopped, and the next test gets a new one. A new server
costs about a minute on 2 cores; a restore about a second.

A dev-mode vLLM server (`harness.engines.vllm_server.VllmServerProcess`, the tiny Llama in float32)
with the harness's file transport registered in vLLM's weight-transfer factory, so the disk data plane
the control suites push with (`DiskSender`'s `{"root"}` / `{"manifest", "path"}`) is one it accepts. No
token (vLLM's dev routes have no auth). `weight_spec()` is the checkpoint's (vLLM has no `/weight_spec`);
`read_weights()` the oracle, through the transport's worker extension (`/collective_rpc weightsync_read`),
not through the sync path.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import safetensors.torch
import torch

from harness.api import TensorSpec

DRAIN_S = 120  # the longest a test's leftover requests may take to end before the server is not reused
CONTEXT = 4096  # the longest request of suites/control asks 2000 tokens
_reads = itertools.count()


class VllmControlServer:
    text_prompts = False  # the tiny model has no tokenizer: vLLM runs with skip_tokenizer_init

    def __init__(self, workdir: Path):
        from harness.engines.tiny_hf_models import TINY_LLAMA, build
        from harness.engines.vllm_server import VllmServerProcess

        self._use(workdir)
        cache = Path(os.environ.get("WEIGHTSYNC_MODEL_CACHE") or self.workdir.parent / "models")
        self.model_dir = build(dataclasses.replace(TINY_LLAMA, max_position_embeddings=CONTEXT), cache)
        # vLLM's ZMQ sockets live under the server's workdir, and a socket path has 107 characters at most:
        # a test's tmp_path is too deep for it, so the server's own files go to a short /tmp folder (not
        # $TMPDIR: the vLLM tier points it at a deep private folder)
        self._server_dir = Path(tempfile.mkdtemp(prefix="ws-vllm-", dir="/tmp"))
        self.process = VllmServerProcess(self.model_dir, self._server_dir, max_model_len=CONTEXT)
        self.process.cmd.append("--enable-server-load-tracking")  # /load counts what is in flight
        self.process.start()
        self.url = self.process.url
        self.token = None
        base = safetensors.torch.load_file(str(self.model_dir / "model.safetensors"))
        self._spec = {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in base.items()}

    def _use(self, workdir: Path) -> None:
        """Serve the test whose folder is `workdir`: its checkpoints go under its own data directory."""
        self.workdir = Path(workdir)
        self.data_dir = self.workdir / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def weight_spec(self) -> dict[str, TensorSpec]:
        return dict(self._spec)

    def read_weights(self) -> dict[str, torch.Tensor]:
        path = self.workdir / f"readback-{next(_reads)}.safetensors"
        resp = httpx.post(
            self.url + "/collective_rpc",
            json={"method": "weightsync_read", "kwargs": {"path": str(path)}},
            timeout=300,
        )
        assert resp.status_code == 200, resp.text[:300]
        return safetensors.torch.load_file(str(path))

    def close(self) -> None:
        """Keep this server for the next test when it could be put back to a fresh one's state."""
        global _spare
        if _spare is None and self.process.alive and self._restore():
            _spare = self
        else:
            self.stop()

    def stop(self) -> None:
        try:
            self.process.stop()
        finally:
            shutil.rmtree(self._server_dir, ignore_errors=True)

    def _restore(self) -> bool:
        """Put this server back to a fresh one's state over its routes; True once every part was checked
        (the weights read back equal the checkpoint bit for bit)."""
        from harness.engines.vllm_constants import INITIAL_VERSION
        from harness.paths.disk import DiskSender

        restore = self._server_dir / "restore"
        shutil.rmtree(restore, ignore_errors=True)
        try:
            with httpx.Client(base_url=self.url, timeout=120, headers={"Connection": "close"}) as http:

                def post(route: str, **kwargs) -> httpx.Response:
                    resp = http.post(route, **kwargs)
                    resp.raise_for_status()
                    return resp

                if http.get("/is_sleeping").json().get("is_sleeping"):
                    post("/wake_up")
                post("/abort_requests", json={})  # what a test left in flight, held ones too
                post("/resume")
                # vLLM 0.32 let held streaming requests run on to their end here (they finished "length"):
                # the server is handed on only once nothing is in flight (/load, --enable-server-load-tracking)
                deadline = time.monotonic() + DRAIN_S
                while http.get("/load").json().get("server_load", 0) > 0:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.05)
                rpc = post("/collective_rpc", json={"method": "weightsync_discard", "kwargs": {}})
                if any(r.get("active") for r in rpc.json()["results"]):
                    post("/finish_weight_update", json={})  # closes the open update, applies nothing
                base = safetensors.torch.load_file(str(self.model_dir / "model.safetensors"))
                sender = DiskSender(restore)
                post("/init_weight_transfer_engine", json={"init_info": sender.init()})
                post("/start_weight_update")
                post("/update_weights", json={"update_info": sender.prepare(1, base)})
                post("/finish_weight_update", json={"weight_version": INITIAL_VERSION})
                post("/reset_prefix_cache", params={"reset_running_requests": "true"})
                path = restore / "readback.safetensors"
                post("/collective_rpc", json={"method": "weightsync_read", "kwargs": {"path": str(path)}})
                back = safetensors.torch.load_file(str(path))
                post("/shutdown_weight_transfer_engine")  # forgets every root it was given
                return (
                    http.get("/weight_info").json().get("weight_version") == INITIAL_VERSION
                    and not http.get("/is_paused").json().get("is_paused")
                    and back.keys() == base.keys()
                    and all(torch.equal(back[n], t) for n, t in base.items())
                )
        except Exception:  # noqa: BLE001 - not restorable for certain: the next test starts a new server
            return False
        finally:
            shutil.rmtree(restore, ignore_errors=True)


#: The server of the last test, put back to a fresh state when that test closed it.
_spare: VllmControlServer | None = None


@atexit.register
def release_spare() -> None:
    """Stop the server kept for the next test, if one is kept."""
    global _spare
    server, _spare = _spare, None
    if server is not None:
        server.stop()


def start(workdir: Path) -> VllmControlServer:
    """The spare server, when the last test left one, serving this test; else a new server."""
    global _spare
    server, _spare = _spare, None
    if server is not None and server.process.alive:
        server._use(workdir)
        return server
    if server is not None:
        server.stop()
    return VllmControlServer(workdir)
