"""Receiver- and Engine-shaped adapters over a ControlClient, so `harness.deployment.push()` and the
suites drive a remote server (this harness's or a dev-mode vLLM) exactly as they drive local objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from harness import checks, wire
from harness.api import (
    JSON,
    Deployment,
    Engine,
    EngineHandle,
    EngineStateError,
    GenerationRequest,
    PauseMode,
    Receiver,
    RequestStream,
    Sender,
    TensorSpec,
    WeightSpec,
)
from harness.control.client import ControlClient
from harness.engines.vllm_constants import INITIAL_VERSION as VLLM_INITIAL_VERSION


class RemoteReceiver(Receiver):
    """The four phases, over HTTP.

    vLLM has no route to abort an update: its next start_weight_update is refused while one is open,
    and finish would commit what was staged. `discard` is what to do there instead (e.g. have the
    transport drop its staged tensors through /collective_rpc, then finish with nothing staged)."""

    def __init__(self, client: ControlClient, discard: Callable[[ControlClient], None] | None = None):
        self.client = client
        self.discard = discard

    def init_transfer_engine(self, init_info: JSON) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: JSON) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, version: int) -> None:
        self.client.finish_weight_update(version)

    def abort_weight_update(self) -> None:
        if not self.client.abort_weight_update() and self.discard is not None:
            self.discard(self.client)


class RemoteEngine(Engine):
    """An engine behind a control server. The oracle is not served over HTTP: pass `oracle` (e.g. the
    in-process engine's read_weights), or `direct` (the same engine reached another way, e.g. a rank's
    pipe, which also answers model_config and max_running_requests), when the test can reach it."""

    def __init__(
        self,
        client: ControlClient,
        oracle: Callable[[], dict[str, torch.Tensor]] | None = None,
        direct: Engine | None = None,
    ):
        self.client = client
        self._oracle = oracle or (direct.read_weights if direct is not None else None)
        self._direct = direct

    @property
    def max_running_requests(self) -> int | None:
        return self._direct.max_running_requests if self._direct is not None else None

    def model_config(self) -> JSON | None:
        return self._direct.model_config() if self._direct is not None else None

    @property
    def weight_version(self) -> int:
        info = self.client.weight_status()
        if isinstance(info.get("engine_version"), int):
            return info["engine_version"]
        label = info.get("weight_version")
        if label in (None, "", VLLM_INITIAL_VERSION):
            return 0
        if isinstance(label, str) and label.isdigit():
            return int(label)
        raise EngineStateError(f"the server reports weight_version {label!r}, not an integer version")

    def weight_spec(self) -> dict[str, TensorSpec]:
        return wire.spec_from_json(self.client.weight_spec()) or {}

    def submit(self, request: GenerationRequest) -> RequestStream:
        return self.client.submit(request)

    def generate(self, requests: Sequence[GenerationRequest], timeout: float = 60.0):
        streams = [self.submit(r) for r in requests]
        return [s.result(timeout) for s in streams]

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = False) -> None:
        self.client.pause(mode, clear_cache=clear_cache)

    def resume(self) -> None:
        self.client.resume()

    @property
    def is_paused(self) -> bool:
        return self.client.is_paused()

    def read_weights(self) -> dict[str, torch.Tensor]:
        if self._oracle is None:
            raise NotImplementedError("a remote engine's oracle needs a direct reader (pass oracle=...)")
        return self._oracle()

    def live_digests(self) -> dict[str, list]:
        """The oracle's read digested where the direct reader can (a rank), else here (checks.live_digests)."""
        if self._direct is not None:
            return checks.live_digests(self._direct)
        return checks.digest_weights(self.read_weights())

    def commit_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        raise EngineStateError(
            "a remote engine commits only through its receiver's lifecycle (finish_weight_update)"
        )

    def reset_prefix_cache(self) -> None:
        self.client.reset_prefix_cache()

    def shutdown(self) -> None:
        self.client.close()


class RemoteDeployment(Deployment):
    """A trainer-side Sender wired to N control servers; `push()` drives it as any deployment."""

    def __init__(
        self,
        sender: Sender,
        clients: Sequence[ControlClient],
        oracles: Sequence[Callable[[], dict[str, torch.Tensor]] | None] | None = None,
        discard: Callable[[ControlClient], None] | None = None,
    ):
        self.sender = sender
        self.init_info = sender.init()
        oracles = list(oracles) if oracles is not None else [None] * len(clients)
        self.handles = []
        for client, oracle in zip(clients, oracles, strict=True):
            receiver = RemoteReceiver(client, discard)
            receiver.init_transfer_engine(self.init_info)
            self.handles.append(EngineHandle(receiver, RemoteEngine(client, oracle)))

    def reset(self, spec: WeightSpec | None = None) -> None:
        raise EngineStateError("a remote deployment cannot replace its servers' engines; start new servers")

    def close(self) -> None:
        for h in self.handles:
            h.engine.shutdown()
        self.sender.shutdown()
