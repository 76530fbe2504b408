"""Model weights through the path: full model pushes, consecutive trainer versions, tied embeddings."""

from __future__ import annotations

from fixtures.payloads import random_like_spec
from harness.checks import assert_bitwise_equal
from harness.deployment import push
from harness.trainer import ReferenceTrainer
from suites.conformance.helpers import push_and_check, push_trainer_steps, rerun_hint


def test_full_model_update_is_bitwise(weightsync_deployment, weightsync_backend, request):
    """Every tensor of the engine's own model (checkpoint names, fused groups whole) arrives exact."""
    spec = weightsync_deployment.handles[0].engine.weight_spec()
    for version in (1, 2, 5):
        weights = random_like_spec(spec, seed=version)
        push_and_check(
            weightsync_deployment,
            version,
            weights,
            f"{weightsync_backend.name} model version {version}",
            rerun_hint(request),
        )


def test_consecutive_trainer_versions_each_land(weightsync_deployment, weightsync_backend, request):
    """Versions from seeded AdamW steps (most entries unchanged between steps), each pushed in full."""
    trainer = ReferenceTrainer(weightsync_deployment.handles[0].engine.weight_spec(), seed=3)
    push_trainer_steps(
        weightsync_deployment, trainer, 6, f"{weightsync_backend.name} step", rerun_hint(request)
    )


def test_partial_update_keeps_the_rest(weightsync_deployment, weightsync_backend, request):
    """Pushing a subset of names changes those and leaves every other tensor bit for bit."""
    engine = weightsync_deployment.handles[0].engine
    before = engine.read_weights()
    spec = engine.weight_spec()
    name = next(n for n in spec if n.endswith("norm.weight"))
    new = random_like_spec({name: spec[name]}, seed=9)
    push(weightsync_deployment, 1, new)
    expected = {**before, **new}
    for i, h in enumerate(weightsync_deployment.handles):
        assert_bitwise_equal(
            expected,
            h.engine.read_weights(),
            f"{weightsync_backend.name} partial update, engine {i}",
            rerun_hint(request),
        )
