"""A run's engine's modules are in every warm rank, whoever boots the fork server first.

A rank is a fork of harness.warm's server, which imports modules once, when it boots. The run's engine
names what its ranks need (`WARM_PRELOAD`: vLLM's import is seconds a rank); a ceiling or a supervised
rank boots the server without naming any engine, and before the plugin named the run's engine ahead of
any boot, every vLLM rank of such a run imported vLLM again (72 % of the vLLM fault matrix's CPU).

Here the engine is this module (the reference engine, naming a small standard module no preload imports),
and the first boot is a caller that names no engine: the child must have the module; with the reference
engine named instead it must not (the probe can fail).
"""

from __future__ import annotations

import pytest

from harness.engines.reference import make_engine  # noqa: F401 - the engine a run names by this module
from suites.meta.warm_pytest import runpytest_warm

pytest_plugins = ["pytester"]
pytestmark = [pytest.mark.meta, pytest.mark.multiproc]

PROBE_MODULE = "colorsys"
#: What harness.warm.engine_preload reads from an engine's module.
WARM_PRELOAD = (PROBE_MODULE,)

PROBE = f"""
from harness import warm


def test_a_child_of_a_server_booted_without_an_engine_has_the_runs_engine_modules():
    ctx = warm.context()  # as a ceiling or a supervised rank boots it: no engine named
    with ctx.Pool(1) as pool:
        imported = pool.apply(eval, ("{PROBE_MODULE!r} in __import__('sys').modules",))
    assert imported, "the warm child lacks {PROBE_MODULE}: the run's engine modules were not preloaded"
"""


@pytest.mark.parametrize(
    ("engine", "preloaded"),
    [("suites.meta.test_warm_preload:make_engine", True), ("reference", False)],
    ids=["engine-names-it", "reference"],
)
def test_the_runs_engine_modules_are_in_every_warm_child(pytester, engine, preloaded):
    pytester.makepyfile(test_probe=PROBE)
    result = runpytest_warm(
        pytester, "-p", "no:cacheprovider", "-p", "no:randomly", f"--weightsync-engine={engine}"
    )
    outcomes = result.parseoutcomes()
    expected = "passed" if preloaded else "failed"
    assert outcomes.get(expected) == 1, (
        f"--weightsync-engine={engine}: the probe should have {expected} ({PROBE_MODULE} "
        f"{'in' if preloaded else 'not in'} a warm child); outcomes {outcomes}\n"
        + "\n".join(result.outlines[-30:])
    )
