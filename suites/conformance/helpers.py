"""Helpers the conformance tests share; they carry the docstrings so the tests stay short."""

from __future__ import annotations

import copy
import shlex

import torch

from harness.api import Deployment
from harness.checks import assert_bitwise_equal
from harness.deployment import push


def rerun_hint(request) -> str:
    """The command that reruns this one test against the same selection."""
    cfg = request.config
    backend = request.node.callspec.params["ws_target"][0] if hasattr(request.node, "callspec") else ""
    args = [
        "pytest",
        request.node.nodeid,
        f"--weightsync-backend={backend or cfg.getoption('--weightsync-backend')}",
        f"--weightsync-engine={cfg.getoption('--weightsync-engine')}",
    ]
    return " ".join(shlex.quote(a) for a in args)


def snapshot(deployment: Deployment) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(version, oracle weights) of every engine."""
    return [(h.engine.weight_version, h.engine.read_weights()) for h in deployment.handles]


def assert_engines_hold(deployment: Deployment, version: int, expected: dict[str, torch.Tensor], context: str, rerun=""):
    """Every engine serves `version` and holds `expected` bit for bit (read through the oracle)."""
    for i, h in enumerate(deployment.handles):
        got_version = h.engine.weight_version
        assert got_version == version, f"{context}: engine {i} serves version {got_version}, expected {version}"
        assert_bitwise_equal(expected, h.engine.read_weights(), f"{context}: engine {i} at version {version}", rerun)


def assert_unchanged(deployment: Deployment, before, context: str) -> None:
    """Every engine still serves the version and weights it had in `before` (a snapshot)."""
    for i, (h, (version, weights)) in enumerate(zip(deployment.handles, before)):
        now = h.engine.weight_version
        assert now == version, f"{context}: engine {i} moved from version {version} to {now}"
        assert_bitwise_equal(weights, h.engine.read_weights(), f"{context}: engine {i} weights changed")


def push_and_check(deployment: Deployment, version: int, tensors: dict[str, torch.Tensor], context: str, rerun=""):
    push(deployment, version, tensors)
    expected = {n: t.contiguous() for n, t in tensors.items()}
    assert_engines_hold(deployment, version, expected, context, rerun)



def deliver_tampered(deployment: Deployment, version: int, tensors: dict[str, torch.Tensor], tamper) -> None:
    """Like push(), but every receiver gets `tamper(update_info)` while the sender transmits the
    genuine bytes: what a corrupted or forged control message looks like to the engine."""
    import concurrent.futures as cf

    for h in deployment.handles:
        h.receiver.start_weight_update()
    info = deployment.sender.prepare(version, tensors)
    forged = tamper(copy.deepcopy(info))
    with cf.ThreadPoolExecutor(len(deployment.handles) + 1) as pool:
        futures = [pool.submit(deployment.sender.transmit)]
        futures += [pool.submit(h.receiver.update_weights, forged) for h in deployment.handles]
    errors = [f.exception() for f in futures if f.exception() is not None]
    for h in deployment.handles:
        h.receiver.abort_weight_update()
    if errors:
        raise errors[0]
