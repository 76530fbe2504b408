"""vLLM's OpenAI-compatible server in dev mode, started by the harness, driven over HTTP.

`VllmServerProcess` starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with
VLLM_SERVER_DEV_MODE=1 (which mounts /pause, /resume, /is_paused, the weight-transfer routes,
/weight_info, /weight_checker, /collective_rpc, /reset_prefix_cache), waits for /health, keeps its
log, and stops it by its pid (its own process group, so the engine-core child goes too).

`ServerVllm` is the harness Engine over those routes: token-id requests stream from
/v1/completions; the lifecycle goes to vLLM's own weight-transfer routes, exactly what a trainer
would call. Tokens are stamped with the version the harness last committed when they arrive
(/v1/completions does not report per-token versions); commits happen while paused, so the stamp is
right for every token produced before the pause returned or after the resume.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from harness.api import (
    JSON,
    PAUSE_MODES,
    EngineStateError,
    GenerationRequest,
    PauseMode,
    RequestStream,
    TokenEvent,
    WeightSpec,
)
from harness.engines.vllm import VLLM_CAPABILITIES
from harness.engines.vllm_adapter import (
    VllmEngine,
    harness_error,
    parse_version,
    refuse_foreign_spec,
    tiny_model_dir,
)
from harness.engines.vllm_cores import pin_engine_core
from harness.engines.vllm_settings import BACKEND, DEFAULT_KV_CACHE_BYTES, VllmSettings

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


#: What torchrun sets in its workers; vLLM would read them as its own world's (validate-cluster --engine vllm).
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
)
TORCHRUN_ENV += ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServerProcess:
    """One dev-mode vLLM server subprocess: start, health-check, log, stop by pid."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        workdir: str | os.PathLike,
        dtype: str = "float32",
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        seed: int = 0,
        python: str = sys.executable,
        weight_transfer: str = BACKEND,
    ):
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "server.log"
        self.max_num_seqs = max_num_seqs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        settings = VllmSettings(dtype, max_model_len, max_num_seqs, kv_cache_bytes, seed, weight_transfer)
        self.cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            *settings.server_args(self.model_dir),
            "--host", "127.0.0.1",
            "--port", str(self.port),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        tmp = self.workdir / "tmp"  # vLLM writes rendezvous files under TMPDIR
        tmp.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the in-process form sets it to 0 in our env
        for name in TORCHRUN_ENV:  # a server started by a torchrun worker is not a member of its world
            env.pop(name, None)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_HOST_IP="127.0.0.1",
            HF_HUB_OFFLINE="1",
            TMPDIR=str(tmp),
        )
        return env

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                cwd=self.workdir,
                start_new_session=True,  # its own process group: the engine core is stopped with it
            )
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        pin_engine_core(self.proc.pid)  # on a small host, the last CPU is left to the API server

    def wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            try:  # the poll interval is a bounded wait on the process itself
                rc = self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            raise EngineStateError(
                f"vLLM server (pid {self.proc.pid}) exited with {rc} before it was healthy; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        raise EngineStateError(
            f"vLLM server (pid {self.proc.pid}) not healthy after {timeout}s; log:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """SIGTERM the server by its pid, SIGKILL its process group if anything is left after the
        grace period. Returns the exit code."""
        if self.proc is None:
            return None
        pid = self.proc.pid
        if self.proc.poll() is None:
            os.kill(pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:  # the group is ours (start_new_session); reap whatever outlived the server
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
        return rc


class ServerVllm(VllmEngine):
    """The harness Engine over a dev-mode vLLM server."""

    form = "server"

    def __init__(self, model_dir: str | os.PathLike, workdir: str | os.PathLike, **server_options: Any):
        super().__init__(model_dir, workdir)
        self.server = VllmServerProcess(model_dir, workdir, **server_options)
        self.max_num_seqs = self.server.max_num_seqs
        self.server.start()
        # A route that raises makes uvicorn drop the connection after its 500: no keep-alive reuse.
        self.http = httpx.Client(
            base_url=self.server.url,
            timeout=httpx.Timeout(300.0, connect=10.0),
            headers={"Connection": "close"},
        )
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self.request_errors: dict[str, str] = {}  # request id -> why its stream ended early
        self._version = parse_version(self.vllm_weight_version())
        with open(self.model_dir / "config.json") as f:
            self.vocab_size = int(json.load(f)["vocab_size"])

    # ------------------------------------------------------------------ HTTP
    def call(self, method: str, route: str, what: str | None = None, **kwargs: Any) -> httpx.Response:
        """One request to the server; a non-2xx answer raises the harness error it stands for."""
        try:
            resp = self.http.request(method, route, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineStateError(
                f"vLLM server {route}: {type(exc).__name__}: {exc}; alive={self.server.alive}"
            ) from exc
        if resp.status_code >= 400:
            raise harness_error(resp.text, f"vLLM server {what or route} (HTTP {resp.status_code})")
        return resp

    # ------------------------------------------------------------------ control plane
    def init_weight_transfer_engine(self, init_info: JSON) -> None:
        self.call("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, update_info: JSON) -> None:
        self.call("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else {}
        self.call("POST", "/finish_weight_update", json=body)
        self._version = parse_version(self.vllm_weight_version())

    def collective_rpc(self, method: str, kwargs: JSON | None = None) -> list[Any]:
        resp = self.call(
            "POST", "/collective_rpc", what=method, json={"method": method, "kwargs": kwargs or {}}
        )
        return resp.json()["results"]

    def vllm_weight_version(self) -> str:
        return self.call("GET", "/weight_info").json()["weight_version"]

    def reset_prefix_cache(self, reset_running_requests: bool = True) -> None:
        """Drop every cached KV block; with reset_running_requests, running requests' blocks too
        (vLLM preempts them and they recompute), so no block computed with old weights survives."""
        params = {"reset_running_requests": str(reset_running_requests).lower()}
        if not self.call("POST", "/reset_prefix_cache", params=params).json().get("success"):
            raise EngineStateError("vLLM server refused to reset its prefix cache (blocks still in use)")

    # ------------------------------------------------------------------ pause
    def pause(self, mode: PauseMode = "abort", clear_cache: bool = False) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.call("POST", "/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        self.call("POST", "/resume")

    @property
    def is_paused(self) -> bool:
        return bool(self.call("GET", "/is_paused").json()["is_paused"])

    # ------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest) -> RequestStream:
        request.check(self.vocab_size)
        stream = RequestStream(request)
        th = threading.Thread(
            target=self._pump, args=(stream,), name=f"vllm-stream-{request.request_id}", daemon=True
        )
        with self._lock:
            self._threads.add(th)
        th.start()
        return stream

    def completion_body(self, request: GenerationRequest, stream: bool) -> JSON:
        return {
            "model": str(self.model_dir),
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stop_token_ids": list(request.stop_token_ids),
            "return_token_ids": True,
            "stream": stream,
        }

    def _pump(self, stream: RequestStream) -> None:
        """Read one streaming completion into `stream`; it always ends with a finish_reason."""
        req = stream.request
        produced, finish = 0, None
        try:
            with self.http.stream("POST", "/v1/completions", json=self.completion_body(req, True)) as resp:
                if resp.status_code >= 400:
                    self.request_errors[req.request_id] = (
                        f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')}"
                    )
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    body = line[len("data: ") :]
                    if body == "[DONE]":
                        break
                    chunk = json.loads(body)
                    if "choices" not in chunk:
                        self.request_errors[req.request_id] = f"error chunk: {body[:500]}"
                        continue
                    choice = chunk["choices"][0]
                    tokens = choice.get("token_ids") or []
                    reason = choice.get("finish_reason")
                    if reason is not None:
                        finish = reason if reason in ("length", "stop", "abort") else "abort"
                    for i, tok in enumerate(tokens):
                        last = i == len(tokens) - 1
                        stream.push(
                            TokenEvent(req.request_id, produced, tok, self._version, finish if last else None)
                        )
                        produced += 1
                    if finish is not None and not tokens:
                        stream.push(TokenEvent(req.request_id, produced, None, self._version, finish))
        except Exception as exc:  # noqa: BLE001 - recorded, and the stream still ends
            self.request_errors[req.request_id] = f"{type(exc).__name__}: {exc}"
        finally:
            if not stream.done:
                if finish is None and req.request_id not in self.request_errors:
                    self.request_errors[req.request_id] = "stream ended without a finish_reason"
                stream.push(TokenEvent(req.request_id, produced, None, self._version, "abort"))
            with self._lock:
                self._threads.discard(threading.current_thread())

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        self.server.stop()
        with self._lock:
            threads = list(self._threads)
        for th in threads:
            th.join(timeout=10)
        self.http.close()


def make_engine(spec: WeightSpec | None = None) -> ServerVllm:
    """Engine factory `vllm-server`: real vLLM as a dev-mode server in a process of its own, serving the tiny
    Llama of harness.engines.tiny_hf_models (`harness.engines.vllm:make_engine`'s model). For a caller that
    is itself a member of a torch.distributed world (a torchrun worker), where an in-process vLLM would join
    that world instead of making its own. vLLM serves a fixed model: a spec must be a subset of its own."""
    # vLLM's ZMQ sockets live under the server's TMPDIR (workdir/tmp): a unix socket path has 107 bytes at most,
    # which a pytest tmp dir as TMPDIR overruns (measured in the vLLM tier), so the workdir is a short /tmp one
    workdir = tempfile.mkdtemp(prefix="ws-vllm-", dir="/tmp" if os.path.isdir("/tmp") else None)
    engine = ServerVllm(tiny_model_dir(), workdir)
    engine.owns_workdir = True
    return refuse_foreign_spec(engine, spec)


make_engine.capabilities = VLLM_CAPABILITIES  # type: ignore[attr-defined]
