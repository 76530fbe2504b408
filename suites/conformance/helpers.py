"""Helpers the conformance tests share; they carry the docstrings so the tests stay short."""

from __future__ import annotations

import copy
import itertools
import shlex
from collections.abc import Mapping, Sequence

import pytest
import torch

from harness.api import Completion, Deployment, Engine, GenerationRequest, RequestStream
from harness.checks import assert_bitwise_equal
from harness.deployment import push
from harness.engines.reference import PREFIX_BLOCK
from harness.independent_forward import IndependentForward, OracleMissing, OracleUnavailable, score, summary
from harness.pytest_plugin import MISSING_DEPENDENCY, NOT_SUPPORTED

LONG = 48  # tokens of a request that is expected to run to its end
# Requests that must still be running when pause arrives: an engine in another process runs ahead
# of what the caller has seen, so they are long enough for any engine to be caught mid-way.
ABORTED_LEN = 4096
KEPT_LEN = 512
PI_PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
PREFIX_BLOCKS = (
    PREFIX_BLOCK,
    16,
)  # prefix-cache block sizes: the reference engine's, vLLM's (prompts cut at both)
_ids = itertools.count()


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
    if "weightsync_tied_deployment" in request.fixturenames:
        args.append(f"--weightsync-tied-engine={cfg.getoption('--weightsync-tied-engine')}")
    return " ".join(shlex.quote(a) for a in args)


def snapshot(deployment: Deployment) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(version, oracle weights) of every engine."""
    return [(h.engine.weight_version, h.engine.read_weights()) for h in deployment.handles]


def assert_engines_hold(
    deployment: Deployment, version: int, expected: dict[str, torch.Tensor], context: str, rerun=""
):
    """Every engine serves `version` and holds `expected` bit for bit (read through the oracle)."""
    for i, h in enumerate(deployment.handles):
        got_version = h.engine.weight_version
        assert got_version == version, (
            f"{context}: engine {i} serves version {got_version}, expected {version}"
        )
        assert_bitwise_equal(
            expected, h.engine.read_weights(), f"{context}: engine {i} at version {version}", rerun
        )


def assert_unchanged(deployment: Deployment, before, context: str) -> None:
    """Every engine still serves the version and weights it had in `before` (a snapshot)."""
    for i, (h, (version, weights)) in enumerate(zip(deployment.handles, before)):
        now = h.engine.weight_version
        assert now == version, f"{context}: engine {i} moved from version {version} to {now}"
        assert_bitwise_equal(weights, h.engine.read_weights(), f"{context}: engine {i} weights changed")


def push_and_check(
    deployment: Deployment, version: int, tensors: dict[str, torch.Tensor], context: str, rerun=""
):
    push(deployment, version, tensors)
    expected = {n: t.contiguous() for n, t in tensors.items()}
    assert_engines_hold(deployment, version, expected, context, rerun)


def push_trainer_steps(deployment: Deployment, trainer, steps: int, context: str, rerun="") -> None:
    """Pushes the trainer's next `steps` versions, each in full and checked on every engine as it lands
    (`context` names a step; its version is appended)."""
    for _ in range(steps):
        version, weights = trainer.step()
        push(deployment, version, weights)
        assert_engines_hold(deployment, version, weights, f"{context} {version}", rerun)


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


# ------------------------------------------------------------------------------------ requests in flight
def pause_request(max_tokens: int = LONG, prompt: Sequence[int] = PI_PROMPT) -> GenerationRequest:
    """A greedy request with a fresh id."""
    return GenerationRequest(f"pause-{next(_ids)}", tuple(prompt), max_tokens)


def requests_in_flight(
    engine: Engine, n=2, tokens=2, max_tokens=LONG, prompt=PI_PROMPT
) -> list[RequestStream]:
    """n streaming requests that have each produced at least `tokens` tokens."""
    streams = [engine.submit(pause_request(max_tokens, prompt)) for _ in range(n)]
    for s in streams:
        assert s.wait_for_tokens(tokens, timeout=60), f"request {s.request.request_id} produced no tokens"
    return streams


def kept_in_flight(engine: Engine, prompt=PI_PROMPT) -> tuple[list[RequestStream], list[int], int]:
    """Requests caught mid-way by pause(keep): (streams, tokens each had at the pause, max_tokens).

    Retry budget: 3 attempts. A fast engine can finish a request between the caller seeing its first
    tokens and the pause landing; then nothing is left to continue on the new version, and the scenario
    is run again with longer requests (within a 4096-token context: a prompt of 8 and 3584 new tokens fit)."""
    for max_tokens in (KEPT_LEN, 4 * KEPT_LEN, 7 * KEPT_LEN):
        streams = requests_in_flight(engine, max_tokens=max_tokens, prompt=prompt)
        engine.pause("keep")
        frozen = [s.token_count for s in streams]
        if all(f < max_tokens for f in frozen):
            return streams, frozen, max_tokens
        engine.resume()  # one finished before the pause: let the rest run out, and try longer ones
        for s in streams:
            s.result(timeout=120)
    pytest.fail(
        f"3 attempts: a request of up to {max_tokens} tokens finished before pause(keep) landed "
        f"each time (tokens at the pause: {frozen})"
    )


# ------------------------------------------------------------------------------------ computed output
def independent_forward(engine: Engine, checkpoint: Mapping[str, torch.Tensor]) -> IndependentForward:
    """The checkpoint run by transformers, built from the engine's model_config() (NOT_SUPPORTED when the
    engine names no model; MISSING_DEPENDENCY when transformers is missing: certify cannot decide then)."""
    config = engine.model_config()
    if config is None:
        pytest.skip(
            f"{NOT_SUPPORTED}: the engine names no model (model_config() is None) to compute independently"
        )
    try:
        return IndependentForward(config).load(checkpoint)
    except OracleMissing as exc:  # the check cannot run on this install: never a pass
        pytest.skip(f"{MISSING_DEPENDENCY}: {exc}")
    except OracleUnavailable as exc:
        pytest.skip(str(exc))


def assert_computes_like(
    fwd: IndependentForward, completion: Completion, prompt: Sequence[int], context: str, rerun: str = ""
) -> None:
    """Every greedy token the engine produced is the independent forward's first choice (near ties aside)."""
    found = score(fwd, prompt, completion.token_ids)
    assert not found, (
        f"{context}: request {completion.request_id} (prompt {list(prompt)[:12]}..., {len(completion.token_ids)} "
        f"tokens) does not compute like an independent forward of the pushed checkpoint; {len(found)} token(s) "
        f"differ:\n{summary(found)}\nrerun: {rerun}"
    )
