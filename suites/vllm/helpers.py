"""Helpers the vLLM tests share; they carry the docstrings so the tests stay short."""

from __future__ import annotations

import itertools
import shlex

import torch

from harness.api import Completion, Deployment, GenerationRequest
from harness.checks import assert_bitwise_equal
from harness.deployment import push
from harness.engines.tiny_hf_models import hf_greedy, random_checkpoint

PROMPTS: tuple[tuple[int, ...], ...] = ((1, 10, 20, 30), (1, 5, 6), (7, 300, 11, 12, 13, 400, 9))
GREEDY_TOKENS = 12
LONG_TOKENS = 4000  # ~7 s of decoding on the tiny model: still running when a pause lands
_request_ids = itertools.count()
_seeds = itertools.count(1000)


def engine_of(deployment: Deployment):
    return deployment.handles[0].engine


def rerun(request) -> str:
    """The command that reruns this one test."""
    return f"python -m pytest {shlex.quote(request.node.nodeid)} -m vllm"


def next_version(deployment: Deployment) -> int:
    """A version newer than the one served (session engines only move forward)."""
    return engine_of(deployment).weight_version + 1


def fresh_weights(deployment: Deployment, names=None) -> dict[str, torch.Tensor]:
    """New seeded values for every checkpoint tensor of the served model (or those in `names`)."""
    engine = engine_of(deployment)
    spec = engine.weight_spec()
    template = {
        n: torch.empty(s.shape, dtype=s.dtype) for n, s in spec.items() if names is None or n in names
    }
    return random_checkpoint(template, seed=next(_seeds))


def push_new_version(deployment: Deployment, names=None) -> tuple[int, dict[str, torch.Tensor]]:
    """Push fresh weights (all, or `names`) as the next version; returns (version, what was pushed)."""
    version = next_version(deployment)
    weights = fresh_weights(deployment, names)
    push(deployment, version, weights)
    return version, weights


def snapshot(deployment: Deployment) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, oracle weights) of the engine."""
    engine = engine_of(deployment)
    return engine.weight_version, engine.read_weights()


def assert_serves(
    deployment: Deployment, version: int, expected: dict[str, torch.Tensor], context: str, hint: str
):
    """The engine reports `version` and computes with `expected`, bit for bit (read via the kernels)."""
    engine = engine_of(deployment)
    got = engine.weight_version
    assert got == version, (
        f"{context}: {engine.describe()} serves version {got}, expected {version}\nrerun: {hint}"
    )
    assert_bitwise_equal(
        expected, engine.read_weights(), f"{context}: {engine.describe()} at version {version}", hint
    )


def assert_unchanged(deployment: Deployment, before, context: str, hint: str) -> None:
    """The engine still serves the version and weights of `before` (a snapshot)."""
    assert_serves(deployment, before[0], before[1], context, hint)


def token_request(prompt, max_tokens: int, prefix: str = "req") -> GenerationRequest:
    return GenerationRequest(f"{prefix}-{next(_request_ids)}", tuple(prompt), max_tokens)


def greedy(deployment: Deployment, prompts=PROMPTS, max_tokens: int = GREEDY_TOKENS) -> list[Completion]:
    engine = engine_of(deployment)
    return engine.generate([token_request(p, max_tokens, "greedy") for p in prompts], timeout=120)


def transformers_greedy(deployment: Deployment, weights, prompts=PROMPTS, max_tokens: int = GREEDY_TOKENS):
    """What transformers generates greedily from the same checkpoint weights (float32, no cache)."""
    return hf_greedy(engine_of(deployment).model_dir, weights, prompts, max_tokens)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
