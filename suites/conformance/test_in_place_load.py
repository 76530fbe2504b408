"""Engines that load in place (Engine.begin_in_place_load, as vLLM's load_weights writes into the live
parameters): a rollback restores the committed version bit for bit, fused groups included; a commit
installs the version and invalidates caches; no forward pass runs while a load is open; bad writes are
refused before anything of them lands. Engines that only swap whole versions are NOT_SUPPORTED here."""

from __future__ import annotations

import pytest

from fixtures.payloads import random_like_spec
from harness.api import GenerationRequest, ManifestMismatch, UnknownTensorError, VersionError
from harness.checks import assert_bitwise_equal
from harness.pytest_plugin import NOT_SUPPORTED
from suites.conformance.helpers import assert_computes_like, independent_forward, rerun_hint

pytestmark = pytest.mark.single_receiver

PROMPT = tuple(range(7, 7 + 24))


def _open_load(engine, version):
    try:
        return engine.begin_in_place_load(version)
    except NotImplementedError as exc:
        pytest.skip(f"{NOT_SUPPORTED}: the engine does not load in place ({exc})")


def _halves(weights):
    """Two parts of a version, each tensor of a fused group (q/k/v, gate/up) split from its partners."""
    names = sorted(weights)
    return {n: weights[n] for n in names[::2]}, {n: weights[n] for n in names[1::2]}


def test_rollback_restores_the_committed_version_and_no_request_runs_meanwhile(
    weightsync_deployment, request
):
    engine = weightsync_deployment.handles[0].engine
    before = engine.read_weights()
    (served_before,) = engine.generate([GenerationRequest("before", PROMPT, 8)])
    load = _open_load(engine, 1)
    first, _ = _halves(random_like_spec(engine.weight_spec(), seed=51))
    load.write(first)
    during = engine.submit(GenerationRequest("during-load", PROMPT, 8))
    # bounded wait for something that must not happen: a token computed from half-written weights
    assert not during.wait_for_tokens(1, timeout=0.5), (
        "a request produced a token while an in-place load was open"
    )
    load.rollback()
    assert engine.weight_version == 0, (
        f"after rollback the engine serves version {engine.weight_version}, not 0"
    )
    assert_bitwise_equal(
        before, engine.read_weights(), "after an in-place load rolled back", rerun_hint(request)
    )
    after = during.result(timeout=60)
    assert after.token_ids == served_before.token_ids and after.versions_seen == {0}, (
        f"request held over a rolled-back load: {after.token_ids} on {sorted(after.versions_seen)}, "
        f"before the load: {served_before.token_ids}"
    )


def test_commit_installs_the_version_and_invalidates_caches(weightsync_deployment, request):
    engine = weightsync_deployment.handles[0].engine
    engine.generate([GenerationRequest("warm", PROMPT, 4)])  # the prompt's prefix cached under version 0
    new = random_like_spec(engine.weight_spec(), seed=52)
    load = _open_load(engine, 1)
    for part in _halves(new):
        load.write(part)
    load.commit()
    assert engine.weight_version == 1, f"after commit the engine serves version {engine.weight_version}"
    assert_bitwise_equal(new, engine.read_weights(), "after an in-place load committed", rerun_hint(request))
    (c,) = engine.generate([GenerationRequest("after", PROMPT, 12)])
    assert_computes_like(
        independent_forward(engine, new),
        c,
        PROMPT,
        "after an in-place commit (stale prefix cache?)",
        rerun_hint(request),
    )


def test_bad_writes_are_refused_before_anything_of_them_lands(weightsync_deployment, request):
    engine = weightsync_deployment.handles[0].engine
    before = engine.read_weights()
    spec = engine.weight_spec()
    load = _open_load(engine, 1)
    with pytest.raises(VersionError):
        engine.begin_in_place_load(0)
    good = random_like_spec(spec, seed=53)
    name = sorted(spec)[0]
    with pytest.raises(UnknownTensorError):
        load.write({name: good[name], "no.such.tensor": good[name]})
    with pytest.raises(ManifestMismatch):
        load.write({name: good[name], sorted(spec)[1]: good[name].flatten()[:1].clone()})
    load.commit()  # a load of nothing but refused writes: version 1 holds version 0's weights
    assert engine.weight_version == 1, f"after commit the engine serves version {engine.weight_version}"
    assert_bitwise_equal(
        before, engine.read_weights(), "refused in-place writes (nothing may land)", rerun_hint(request)
    )
