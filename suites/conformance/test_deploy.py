"""Deploying with what the backend claims. A backend that claims several receivers, buckets or a GPU
and cannot deploy with them fails here, once, by name ("deploys with 2 receivers: ..."); every other
test that needs that deployment reports NOT_SUPPORTED-because-broken at once instead of an error in
its setup after another wait for the same failure (harness.pytest_plugin.DeploymentPool)."""

from __future__ import annotations

import pytest

from harness.pytest_plugin import DeployFailed

#: The unit the bucket claim is tried with: one test_buckets uses too (the pool shares the deployment).
SMALL_BUCKET_BYTES = 4096


def test_deploys_with_what_it_claims(weightsync_deployment_pool, ws_target, weightsync_capabilities):
    name, n = ws_target
    dep = _get(weightsync_deployment_pool, name, n)
    assert len(dep.handles) == n, f"{name} deployed with {n} receivers holds {len(dep.handles)} engines"
    if weightsync_capabilities.buckets:
        _get(weightsync_deployment_pool, name, n, bucket_bytes=SMALL_BUCKET_BYTES)


def _get(pool, name: str, n: int, **kw):
    why = None
    try:
        return pool.get(name, n, **kw)
    except DeployFailed as exc:
        why = str(exc)
    pytest.fail(why, pytrace=False)  # outside the handler: the message once, without a chained copy
