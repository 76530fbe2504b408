"""vLLM's own trainer-side client drives our control server, unmodified.

`HTTPVLLMWeightSyncClient` (vllm 0.32, `vllm/distributed/weight_transfer/clients.py`) is what a trainer
built on vLLM's `TrainerWeightTransferEngine` calls over HTTP: `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`, `shutdown_weight_transfer_engine`, each a
bare `requests.post` (no auth header, no Content-Type when it sends no body, `raise_for_status`). Here it
talks to `harness.control.server.ControlServer` (auth off on loopback, token=None) in front of a
reference engine and a disk receiver; the data plane is a harness disk checkpoint, so init_info is
`DiskSender.init()` (`{"root"}`) and update_info `DiskSender.prepare()` (`{"path", "manifest"}`), which
the client sends unchanged (`_json_safe_update_payload` only rewrites CUDA `ipc_handles`).

The second half is a request script (`CASES`) that runs the client, case by case, through a recording
pass-through proxy (`Recorder`: the client is only pointed at another URL). Its answers on our server are
checked here against `CASES[...].ours`; suites/control/test_vllm_compat.py runs the same script against
a real vLLM 0.32 server and checks `CASES[...].vllm`, so every difference between the two for the
client's calls is named in one table.

What vLLM's client can send and our server refuses (vLLM takes it): a `weight_version` label that is a
number other than the staged version (409 VersionError; the committed version's number too, while a
newer one is staged: only a finish with no update open is a retry), "0", "", one with a space or longer
than 64 characters (400); the update stays open, a finish the server takes commits it. A finish with
nothing staged, or `init_weight_transfer_engine` with an update open, is 409 here and 200 on vLLM.

    .ci-vllm-venv/bin/python -m pytest suites/vllm/test_vllm_client_drives_ours.py -m vllm

Why one file: the request script (`CASES`) is shared with suites/control/test_vllm_compat.py, and both halves
read it in the same order.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("fastapi")  # the control extra: our server
pytest.importorskip("uvicorn")
pytest.importorskip("requests")  # what vLLM's client posts with

import requests
from vllm.distributed.weight_transfer.clients import (
    HTTPVLLMWeightSyncClient,
    _json_safe_update_payload,
)

from harness.control.app import ServerThread
from harness.control.server import ControlServer, ServerConfig
from harness.engines.reference import ReferenceEngine
from harness.paths.disk import DiskReceiver, DiskSender
from suites.control.helpers import weights_for

pytestmark = pytest.mark.vllm

Tensors = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------- checks
def mismatches(pushed: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """One line per tensor that is not torch.equal to what was pushed: its name, and where it differs."""
    lines = []
    for name, want in pushed.items():
        have = got.get(name)
        if have is None:
            lines.append(f"{name}: missing from the engine (it holds {len(got)} tensors)")
        elif have.dtype != want.dtype or have.shape != want.shape:
            lines.append(
                f"{name}: engine {tuple(have.shape)} {have.dtype}, pushed {tuple(want.shape)} {want.dtype}"
            )
        elif not torch.equal(have, want):
            diff = (have != want).flatten().nonzero()
            i = int(diff[0])
            lines.append(
                f"{name}: {len(diff)} of {want.numel()} values differ; first at flat index {i}: engine "
                f"{have.flatten()[i].item()!r}, pushed {want.flatten()[i].item()!r}"
            )
    return lines


def assert_delivered(
    pushed: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], context: str
) -> None:
    bad = mismatches(pushed, got)
    assert not bad, f"{context}: {len(bad)} of {len(pushed)} tensors not bit for bit:\n  " + "\n  ".join(
        bad[:10]
    )


# --------------------------------------------------------------------------------------------- our server
@dataclasses.dataclass
class Ours:
    """Our control server in front of a reference engine and a disk receiver, no token (loopback)."""

    engine: ReferenceEngine
    thread: ServerThread
    root: Path
    sender: DiskSender

    @property
    def url(self) -> str:
        return self.thread.url

    def get(self, path: str) -> dict[str, Any]:
        resp = requests.get(self.url + path, timeout=30)
        assert resp.status_code == 200, f"GET {path}: {resp.status_code} {resp.text[:300]}"
        return resp.json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=60)

    def weights(self, seed: int) -> Tensors:
        return weights_for(self.engine, seed)

    def read_weights(self) -> Tensors:
        return self.engine.read_weights()

    def reset(self) -> None:
        """Back to 'initialised, no update open', outside the script: drop any open update
        (shutdown_weight_transfer_engine does, here), then init again."""
        for path, body in (
            ("/shutdown_weight_transfer_engine", None),
            ("/init_weight_transfer_engine", {"init_info": self.sender.init()}),
        ):
            resp = self.post(path, body)
            assert resp.status_code == 200, f"reset: POST {path}: {resp.status_code} {resp.text[:300]}"

    def close(self) -> None:
        self.thread.stop()
        self.engine.shutdown()


def serve_ours(root: Path, **config: Any) -> Ours:
    root.mkdir(parents=True, exist_ok=True)
    engine = ReferenceEngine()
    cfg = ServerConfig(token=None, allowed_dirs=(root,), **config)
    thread = ServerThread(ControlServer(engine, DiskReceiver(engine), cfg)).start()
    return Ours(engine, thread, root, DiskSender(root / "checkpoints"))


@pytest.fixture
def ours(tmp_path):
    server = serve_ours(tmp_path / "allowed")
    yield server
    server.close()


def http_error(call: Callable[[], None]) -> requests.Response:
    """The answer the client raised on (it raises requests.HTTPError from raise_for_status)."""
    with pytest.raises(requests.HTTPError) as raised:
        call()
    return raised.value.response


def error_of(resp: requests.Response) -> tuple[int, str | None]:
    try:
        err = resp.json().get("error") or {}
    except ValueError:
        return resp.status_code, None
    return resp.status_code, err.get("type")


# --------------------------------------------------------------------------------------------- ours: delivery
@pytest.mark.parametrize(
    "labels", [("checkpoint/step-1", "checkpoint/step-2"), (None, None)], ids=["label", "none"]
)
@pytest.mark.parametrize("form", ["object", "list"])
def test_vllm_client_drives_two_rounds_bit_for_bit(ours, labels, form):
    client = HTTPVLLMWeightSyncClient(ours.url)
    for version, label in zip((1, 2), labels):
        pushed = ours.weights(seed=10 * version + len(form))
        info = ours.sender.prepare(version, pushed)
        client.init_weight_transfer_engine(ours.sender.init())
        client.start_weight_update()
        client.update_weights(info if form == "object" else [info])
        client.finish_weight_update(label)
        assert_delivered(
            pushed, ours.read_weights(), f"round {version} ({form} update_info, finish {label!r})"
        )
        shown = ours.get("/weight_info")
        # a label is shown as sent; without one our server shows the committed number (vLLM keeps the
        # previous label: test_vllm_compat.py test_client_script_differences_from_vllm[round2])
        expected = label if label is not None else str(version)
        assert shown == {"weight_version": expected}, (
            f"round {version}: /weight_info {shown}, the client's finish sent weight_version={label!r}"
        )
        status = ours.get("/weight_status")
        assert (status["engine_version"], status["update_in_progress"]) == (version, False), status


def test_list_update_info_delivers_this_servers_element(tmp_path):
    """vLLM indexes a list update_info by the worker's global rank; ours takes `worker_index`."""
    ours = serve_ours(tmp_path / "allowed", world_size=2, worker_index=1)
    try:
        client = HTTPVLLMWeightSyncClient(ours.url)
        client.init_weight_transfer_engine(ours.sender.init())
        other, mine = ours.weights(seed=21), ours.weights(seed=22)
        decoy = DiskSender(ours.root / "worker-0").prepare(1, other)
        info = ours.sender.prepare(1, mine)
        client.start_weight_update()
        client.update_weights([decoy, info])
        client.finish_weight_update("checkpoint/step-1")
        assert_delivered(mine, ours.read_weights(), "element 1 of a two-worker list update_info")
        assert ours.get("/weight_info") == {"weight_version": "checkpoint/step-1"}
    finally:
        ours.close()


def test_the_client_sends_disk_update_info_unchanged(ours):
    info = ours.sender.prepare(1, ours.weights(seed=3))
    assert "ipc_handles" not in info
    assert _json_safe_update_payload(info) == info
    assert _json_safe_update_payload([info, info]) == [info, info]
    assert json.loads(json.dumps(info)) == info, "update_info must survive JSON as it is"


def test_stock_vllm_has_no_disk_backend():
    """vLLM 0.32's built-in weight-transfer backends all move tensors between processes of GPUs; none
    reads a checkpoint from disk. The vLLM side of test_vllm_compat.py takes a disk update only because
    the harness registers one (`weightsync_files`, harness/engines/vllm_transport.py, loaded with
    --worker-extension-cls): that is the documented difference of the data plane."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    builtin = set(WeightTransferEngineFactory._registry) - {"weightsync_files"}
    assert builtin == {"nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress"}, builtin


# --------------------------------------------------------------------------------------------- ours: refusals
def test_out_of_order_calls_reach_the_client_as_409_and_the_server_recovers(ours):
    client = HTTPVLLMWeightSyncClient(ours.url)
    client.init_weight_transfer_engine(ours.sender.init())
    pushed = ours.weights(seed=4)
    info = ours.sender.prepare(1, pushed)
    got = {
        "update before start": error_of(http_error(lambda: client.update_weights(info))),
        "finish before start": error_of(http_error(lambda: client.finish_weight_update(None))),
    }
    client.start_weight_update()
    got["start twice"] = error_of(http_error(client.start_weight_update))
    assert got == dict.fromkeys(got, (409, "LifecycleError")), got
    client.update_weights(info)
    client.finish_weight_update("checkpoint/after-refusals")
    assert_delivered(pushed, ours.read_weights(), "the round after the refusals")


# Labels vLLM takes as they are (its finish_weight_update sets any string) and ours refuses: a numeric
# string names the engine version to commit here, and other labels must match
# schemas.VERSION_LABEL_PATTERN. The update stays open; a finish the server takes commits it.
REFUSED_LABELS = {
    "numeric, not the staged version": ("7000", 409, "VersionError"),
    "zero": ("0", 400, "Bad Request"),
    "with a space": ("step 12", 400, "Bad Request"),
    "empty": ("", 400, "Bad Request"),
    "65 characters": ("x" * 65, 400, "Bad Request"),
}


@pytest.mark.parametrize("case", list(REFUSED_LABELS))
def test_labels_vllm_takes_are_refused_here_and_the_update_stays_open(ours, case):
    label, status, kind = REFUSED_LABELS[case]
    client = HTTPVLLMWeightSyncClient(ours.url)
    client.init_weight_transfer_engine(ours.sender.init())
    pushed = ours.weights(seed=5)
    client.start_weight_update()
    client.update_weights(ours.sender.prepare(1, pushed))
    resp = http_error(lambda: client.finish_weight_update(label))
    assert error_of(resp) == (status, kind), (
        f"finish_weight_update({label!r}): {resp.status_code} {resp.text}"
    )
    assert ours.get("/weight_status")["update_in_progress"], "a refused finish must leave the update open"
    client.finish_weight_update("checkpoint/step-1")
    assert_delivered(pushed, ours.read_weights(), f"after finish({label!r}) was refused and retried")


def test_a_finish_labelled_with_the_committed_number_is_refused_and_the_update_stays_open(ours):
    """'2' names version 2 here, already committed while version 3 is staged: not a retry of that commit
    (which would answer 200 and apply nothing, telling vLLM's client the update landed) but a 409."""
    client = HTTPVLLMWeightSyncClient(ours.url)
    client.init_weight_transfer_engine(ours.sender.init())
    for version in (1, 2):
        client.start_weight_update()
        client.update_weights(ours.sender.prepare(version, ours.weights(seed=version)))
        client.finish_weight_update(None)
    staged = ours.weights(seed=3)
    client.start_weight_update()
    client.update_weights(ours.sender.prepare(3, staged))
    resp = http_error(lambda: client.finish_weight_update("2"))
    assert error_of(resp) == (409, "VersionError"), (
        f"finish_weight_update('2'): {resp.status_code} {resp.text}"
    )
    status = ours.get("/weight_status")
    assert (status["engine_version"], status["update_in_progress"]) == (2, True), status
    client.finish_weight_update(None)
    assert_delivered(staged, ours.read_weights(), "version 3, finished after the refused finish('2')")


# --------------------------------------------------------------------------------------------- the request script
@dataclasses.dataclass(frozen=True)
class Exchange:
    """One request the client made and the answer it got, as the proxy saw them."""

    step: str  # the script's name for the call
    method: str
    path: str
    content_type: str | None
    request: Any  # the JSON the client sent; None when it sent no body
    status: int
    answer: Any  # the JSON answer, else its text

    def view(self) -> str:
        """What the table compares: the call, the status, the error's type, the label shown."""
        if self.status < 400:
            if self.path == "/weight_info" and isinstance(self.answer, dict):
                return f"{self.step} {self.answer.get('weight_version')!r}"
            return f"{self.step} {self.status}"
        err = self.answer.get("error") if isinstance(self.answer, dict) else None
        kind = err.get("type") if isinstance(err, dict) else repr(self.answer)
        return f"{self.step} {self.status} {kind}"


def _json_or_text(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]


_NOT_FORWARDED = {"host", "connection", "content-length", "transfer-encoding", "keep-alive"}


class Recorder:
    """A pass-through HTTP proxy on 127.0.0.1 that records every exchange: the client is unmodified,
    only pointed at the proxy's URL. Headers and body go on as sent."""

    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.step = ""
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED}
                resp = requests.request(
                    self.command, recorder.target + self.path, data=body, headers=headers, timeout=600
                )
                recorder.exchanges.append(
                    Exchange(
                        recorder.step,
                        self.command,
                        self.path,
                        self.headers.get("Content-Type"),
                        _json_or_text(body),
                        resp.status_code,
                        _json_or_text(resp.content),
                    )
                )
                self.send_response(resp.status_code)
                self.send_header("Content-Type", resp.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            do_GET = do_POST = forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="recorder", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclasses.dataclass
class Target:
    """A server the script drives: where it listens, a disk sender writing where it may read, seeded
    weights to push, the oracle, and a way back to 'initialised, no update open' between cases."""

    url: str
    sender: DiskSender
    weights: Callable[[int], Tensors]
    read_weights: Callable[[], Tensors]
    reset: Callable[[], None]


class ScriptRun:
    """The client's calls of one case, recorded; `view` is what CASES tabulates."""

    def __init__(self, target: Target, recorder: Recorder):
        self.target, self.recorder = target, recorder
        self.client = HTTPVLLMWeightSyncClient(recorder.url)
        self.view: list[str] = []
        self.version = 0  # the manifest version of the last prepared update
        self.pushed: Tensors | None = None
        self.delivered: list[str] = []  # mismatches() of the last landed() check

    def call(self, step: str, fn: Callable[[HTTPVLLMWeightSyncClient], None]) -> None:
        self.recorder.step = step
        before = len(self.recorder.exchanges)
        try:
            fn(self.client)
        except requests.HTTPError:
            pass  # the proxy recorded the answer; the script goes on as a trainer catching it would
        made = self.recorder.exchanges[before:]
        assert len(made) == 1, f"{step}: the client made {len(made)} requests, expected one"
        self.view.append(made[0].view())

    def init(self) -> None:
        self.call("init", lambda c: c.init_weight_transfer_engine(self.target.sender.init()))

    def start(self) -> None:
        self.call("start", lambda c: c.start_weight_update())

    def update(self, tensors: Tensors | None = None, form: str = "object") -> None:
        self.version += 1
        self.pushed = self.target.weights(self.version) if tensors is None else tensors
        info = self.target.sender.prepare(self.version, self.pushed)
        payload = info if form == "object" else [info]
        self.call("update" if form == "object" else "update[list]", lambda c: c.update_weights(payload))

    def finish(self, label: str | None, shown: str | None = None) -> None:
        self.call(f"finish({shown or repr(label)})", lambda c: c.finish_weight_update(label))

    def shutdown(self) -> None:
        self.call("shutdown", lambda c: c.shutdown_weight_transfer_engine())

    def weight_info(self) -> None:
        self.recorder.step = "weight_info"
        requests.get(self.recorder.url + "/weight_info", timeout=30)
        self.view.append(self.recorder.exchanges[-1].view())

    def landed(self) -> None:
        assert self.pushed is not None
        self.delivered = mismatches(self.pushed, self.target.read_weights())
        self.view.append("landed" if not self.delivered else "not landed")


@dataclasses.dataclass(frozen=True)
class Case:
    """One case of the script: the client's calls, our server's answers, and vLLM's where they differ
    (None: the same as ours), with why."""

    run: Callable[[ScriptRun], None]
    ours: tuple[str, ...]
    vllm: tuple[str, ...] | None = None
    why: str = ""


def _round(label: str | None, form: str) -> Callable[[ScriptRun], None]:
    def run(s: ScriptRun) -> None:
        s.init()
        s.start()
        s.update(form=form)
        s.finish(label)
        s.weight_info()
        s.landed()

    return run


def _finish_with(label: str, shown: str | None = None) -> Callable[[ScriptRun], None]:
    def run(s: ScriptRun) -> None:
        s.start()
        s.update()
        s.finish(label, shown)
        s.weight_info()
        s.landed()

    return run


def _steps(*names: str) -> Callable[[ScriptRun], None]:
    def run(s: ScriptRun) -> None:
        for name in names:
            getattr(s, name)()

    return run


def _update_before_start(s: ScriptRun) -> None:
    s.update()


def _finish_before_start(s: ScriptRun) -> None:
    s.finish(None)


def _empty_update(s: ScriptRun) -> None:
    s.start()
    s.finish(None)


def _refused_update(s: ScriptRun) -> None:
    s.start()
    s.update(tensors={"not.a.weight.of.this.model": torch.zeros(4)})
    s.finish(None)
    s.start()


# The script, in order (the two rounds first: later cases relabel the version). Our answers are
# checked in this file; vLLM's by suites/control/test_vllm_compat.py against a real vLLM 0.32 server.
# Versions: the script numbers its manifests 1, 2, 3, ... per server; round2's finish sends no label.
CASES: dict[str, Case] = {
    "round1": Case(
        _round("checkpoint/step-1", "object"),
        ("init 200", "start 200", "update 200", "finish('checkpoint/step-1') 200",
         "weight_info 'checkpoint/step-1'", "landed"),
    ),
    "round2": Case(
        _round(None, "list"),
        ("init 200", "start 200", "update[list] 200", "finish(None) 200", "weight_info '2'", "landed"),
        ("init 200", "start 200", "update[list] 200", "finish(None) 200", "weight_info 'checkpoint/step-1'",
         "landed"),
        "finish without a label: vLLM keeps the previous label, ours shows the committed version's number",
    ),
    "update_before_start": Case(
        _update_before_start,
        ("update 409 LifecycleError",),
        ("update 500 InternalServerError",),
        "vLLM: 500, the worker's RuntimeError 'start_weight_update must be called before update_weights.' "
        "through its catch-all; ours refuses the order before reading the body (409)",
    ),
    "finish_before_start": Case(
        _finish_before_start,
        ("finish(None) 409 LifecycleError",),
        ("finish(None) 500 InternalServerError",),
        "vLLM: 500, 'finish_weight_update called without a matching start_weight_update.'; ours 409",
    ),
    "start_twice": Case(
        _steps("start", "start"),
        ("start 200", "start 409 LifecycleError"),
        ("start 200", "start 500 InternalServerError"),
        "vLLM: 500, 'start_weight_update called while a weight update is already active.'; ours 409",
    ),
    "init_during_update": Case(
        _steps("start", "init"),
        ("start 200", "init 409 LifecycleError"),
        ("start 200", "init 200"),
        "vLLM's worker initialises the transport again with an update open; ours refuses (409)",
    ),
    "empty_update": Case(
        _empty_update,
        ("start 200", "finish(None) 409 LifecycleError"),
        ("start 200", "finish(None) 200"),
        "a finish with nothing staged: vLLM closes the update and changes nothing; ours refuses (409) and "
        "keeps the update open",
    ),
    "refused_update": Case(
        _refused_update,
        ("start 200", "update 422 UnknownTensorError", "finish(None) 409 LifecycleError", "start 200"),
        ("start 200", "update 500 InternalServerError", "finish(None) 500 InternalServerError", "start 200"),
        "an unknown tensor: vLLM 500 (the transport's 'UnknownTensorError: ...' inside the message) and the "
        "update is over, so the finish is 500 too; ours 422 UnknownTensorError, the update stays open "
        "and the finish closes it with 409",
    ),
    "shutdown_during_update": Case(
        _steps("start", "shutdown"),
        ("start 200", "shutdown 200"),
        ("start 200", "shutdown 500 InternalServerError"),
        "vLLM: 500, 'Cannot release a trainer connection during a weight update' (the update stays open); "
        "ours shuts the transport down and drops the update",
    ),
    "shutdown_then_start": Case(
        _steps("shutdown", "start", "init", "start"),
        ("shutdown 200", "start 409 LifecycleError", "init 200", "start 200"),
        ("shutdown 200", "start 500 InternalServerError", "init 200", "start 200"),
        "start after the transport was shut down: the harness transport in vLLM refuses it (its "
        "LifecycleError reaches vLLM's catch-all, 500); ours 409",
    ),
    "label_committed_number": Case(
        _finish_with("2"),
        ("start 200", "update 200", "finish('2') 409 VersionError", "weight_info '2'", "not landed"),
        ("start 200", "update 200", "finish('2') 200", "weight_info '2'", "landed"),
        "'2' names version 2, committed in round2, while version 3 is staged: ours refuses it (409, the "
        "update stays open; test_a_finish_labelled_with_the_committed_number_is_refused_and_the_update_"
        "stays_open); vLLM takes it as a label and applies the staged update",
    ),
    "label_numeric": Case(
        _finish_with("7000"),
        ("start 200", "update 200", "finish('7000') 409 VersionError", "weight_info '2'", "not landed"),
        ("start 200", "update 200", "finish('7000') 200", "weight_info '7000'", "landed"),
        "a numeric label names the version to commit here; vLLM takes any string as a label",
    ),
    "label_zero": Case(
        _finish_with("0"),
        ("start 200", "update 200", "finish('0') 400 Bad Request", "weight_info '2'", "not landed"),
        ("start 200", "update 200", "finish('0') 200", "weight_info '0'", "landed"),
        "'0' is no version here (1..2**63-1); vLLM takes any string",
    ),
    "label_with_space": Case(
        _finish_with("step 12"),
        ("start 200", "update 200", "finish('step 12') 400 Bad Request", "weight_info '2'", "not landed"),
        ("start 200", "update 200", "finish('step 12') 200", "weight_info 'step 12'", "landed"),
        "our labels match schemas.VERSION_LABEL_PATTERN; vLLM takes any string",
    ),
    "label_empty": Case(
        _finish_with(""),
        ("start 200", "update 200", "finish('') 400 Bad Request", "weight_info '2'", "not landed"),
        ("start 200", "update 200", "finish('') 200", "weight_info ''", "landed"),
        "an empty label: vLLM shows ''; ours refuses it (400)",
    ),
    "label_65_characters": Case(
        _finish_with("x" * 65, shown="'x'*65"),
        ("start 200", "update 200", "finish('x'*65) 400 Bad Request", "weight_info '2'", "not landed"),
        ("start 200", "update 200", "finish('x'*65) 200", f"weight_info {'x' * 65!r}", "landed"),
        "our labels are at most 64 characters; vLLM takes any string",
    ),
}  # fmt: skip


def run_script(target: Target) -> dict[str, ScriptRun]:
    """Every case against `target`, in order, through a Recorder; `target.reset()` before each."""
    recorder = Recorder(target.url)
    runs: dict[str, ScriptRun] = {}
    version = 0
    target.reset()  # every case starts initialised with no update open
    try:
        for name, case in CASES.items():
            s = ScriptRun(target, recorder)
            s.version = version
            case.run(s)
            version = s.version
            runs[name] = s
            target.reset()
    finally:
        recorder.close()
    return runs


@pytest.fixture(scope="module")
def script_on_ours(tmp_path_factory):
    server = serve_ours(tmp_path_factory.mktemp("script") / "allowed")
    try:
        runs = run_script(
            Target(server.url, server.sender, server.weights, server.read_weights, server.reset)
        )
    finally:
        server.close()
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_client_script_on_ours(script_on_ours, case):
    s = script_on_ours[case]
    assert tuple(s.view) == CASES[case].ours, (
        f"{case}: our server answered the client\n  {s.view}\nexpected\n  {list(CASES[case].ours)}"
        + (f"\ndelivery: {s.delivered[:5]}" if s.delivered else "")
    )


def test_client_script_requests_are_vllms_bodies(script_on_ours):
    """What the client puts on the wire: JSON bodies embedded as vLLM's routes declare them, and no body
    (no Content-Type) for start, shutdown and a finish without a label."""
    seen: dict[str, set[tuple[str | None, str]]] = {}
    for x in next(iter(script_on_ours.values())).recorder.exchanges:  # one recorder for the whole script
        if x.method == "POST":
            shape = sorted(x.request) if isinstance(x.request, dict) else x.request
            seen.setdefault(x.path, set()).add((x.content_type, json.dumps(shape)))
    assert seen == {
        "/init_weight_transfer_engine": {("application/json", '["init_info"]')},
        "/start_weight_update": {(None, "null")},
        "/update_weights": {("application/json", '["update_info"]')},
        "/finish_weight_update": {("application/json", '["weight_version"]'), (None, "null")},
        "/shutdown_weight_transfer_engine": {(None, "null")},
    }, seen
