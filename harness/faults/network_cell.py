"""The cell of a network fault (harness.faults.network): the trainer on this host, 2 receiver ranks in
containers on a Docker bridge. Push v1, inject the fault while v2 is on the wire (when the trainer reads
the tensor of bucket 2 of 8 to pack it, bucket 1 being sent), heal, push v3. The verdict, as Jepsen gives
it (harness.checks.judge_cell): safety (every engine serves exactly one committed version, bit for bit),
bounded (the v2 push returns within 2x the backend's timeout), recovery (v3 succeeds everywhere)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from harness.api import Backend, TensorSpec, WeightSyncError
from harness.checks import CellObservation, judge_cell
from harness.deployment import push
from harness.faults import docker_net
from harness.faults.cell import CellResult, cell_versions, detached, read_engines, recover, with_timeout
from harness.faults.container_rank import deploy_broadcast
from harness.faults.network import NETWORK, NetworkFault

# 8 tensors x 2 MiB: 8 buckets (one tensor each), so a fault lands with data on the wire
SPEC = {f"layers.{i}.weight": TensorSpec((512, 1024), torch.float32) for i in range(8)}
TRIGGER = "layers.2.weight"


class _TriggerOnRead(dict):
    """The v2 payload: the first read of `key` once armed (the trainer transmitting) runs `action`.
    `held_s`: how long the action held the trainer's thread (an OOM kill returns once the victim is dead)."""

    def __init__(self, data, key, action):
        super().__init__(data)
        self.key, self.action, self.armed, self.fired, self.held_s = key, action, False, None, 0.0

    def __getitem__(self, name):
        if self.armed and self.fired is None and name == self.key:
            self.fired = time.monotonic()
            try:
                self.action()
            finally:
                self.held_s = time.monotonic() - self.fired
        return super().__getitem__(name)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """The trainer's gloo listens on the bridge for the cell's length."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_network_cell(
    backend: Backend, backend_name: str, fault: NetworkFault, workdir: Path, timeout_s: float,
    host: docker_net.DockerHost,
) -> CellResult:  # fmt: skip
    """Run `fault` on `backend` with its ranks in containers of `host` and judge the cell."""
    result = CellResult(backend_name, fault.kind, 0, "ok", [], point="mid-transmit", family=NETWORK)
    why_not = fault.applies_to_backend(backend_name)
    if why_not:
        result.verdict, result.reasons = "not_applicable", [why_not]
        return result
    backend = with_timeout(backend, timeout_s)
    with (
        _environ(host.trainer_env()),
        deploy_broadcast(
            backend, host, 2, SPEC, str(workdir), container_options=dict(fault.container_options)
        ) as dep,
    ):
        sent = cell_versions(SPEC, seed=1)  # consecutive trainer steps, as every fault cell pushes
        push(dep, 1, sent[1])
        victim, other = dep.ranks[1], dep.ranks[0]  # rank 2 takes the fault
        primitive = fault.primitive(host, victim.container, other.container)
        payload = _TriggerOnRead(sent[2], TRIGGER, primitive.inject)
        transmit = dep.sender.transmit

        def armed_transmit():
            payload.armed = True
            return transmit()

        dep.sender.transmit = armed_transmit
        obs = CellObservation(
            fault=fault,
            timeout_s=timeout_s,
            versions=sent,
            version=2,
            recovery_version=3,
            victim_name=dep.processes()[1].name,
        )
        t0 = time.monotonic()
        try:
            push(dep, 2, payload)
        except WeightSyncError as exc:
            obs.error = detached(exc)
        # the bound is on the sync: the time the injection held the trainer's thread is the harness's own
        obs.detect_s = time.monotonic() - t0 - payload.held_s
        dep.sender.transmit = transmit
        if payload.fired is None:
            primitive.inject()  # never reached bucket 2: inject now, so the cell still tests what it names
        landed = f" (landed in {payload.held_s:.2f}s, not counted)" if payload.held_s >= 0.05 else ""
        result.log.append(
            f"{primitive.description} at +{(payload.fired or time.monotonic()) - t0:.2f}s{landed}"
        )
        if isinstance(primitive, docker_net.OomKill):
            state = primitive.wait(30)
            if not (state["OOMKilled"] and state["ExitCode"] == 137):
                primitive.heal()
                result.verdict, result.reasons = "unknown", [f"the victim was not OOM-killed: {state}"]
                return result
        primitive.heal()
        obs.after_fault = read_engines(dep)
        recover(dep, obs, 3)
        result.verdict, result.reasons = judge_cell(obs)
        result.error, result.detect_s, result.recover_s = obs.error_text(), obs.detect_s, obs.recover_s
        result.timeout_s = timeout_s
        result.log.append(
            f"v2: {obs.error_text() or 'succeeded'} in {obs.detect_s:.1f}s; v3 after heal in "
            f"{obs.recover_s:.1f}s, restarts {getattr(dep, 'restarts', '?')}"
        )
    return result
