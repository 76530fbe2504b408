"""A check that cannot run is not a pass (issue 38): a test skipped because an optional dependency is
missing (the independent forward without transformers) makes certify COULD NOT DECIDE, naming the extra to
install; only NOT_SUPPORTED (a capability the backend does not claim) leaves a PASS standing. Before, such a
skip was neither a failure nor undecided, and an engine whose prefix cache survived a commit, or whose tied
head was never updated, was certified PASS on an install without the `oracle` extra."""

from __future__ import annotations

import json
import sys

import pytest

from harness.report.evidence import decide

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.meta

NODE = "suites/conformance/test_computed_output.py::test_engine_computes_like_an_independent_forward[ipc-2rx]"


def test_the_independent_forward_without_transformers_is_a_missing_dependency(monkeypatch):
    from harness.engines.reference import make_engine
    from suites.conformance.helpers import independent_forward

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    engine = make_engine(None)
    try:
        with pytest.raises(pytest.skip.Exception) as skipped:
            independent_forward(engine, engine.read_weights())
    finally:
        engine.shutdown()
    assert str(skipped.value).startswith("MISSING_DEPENDENCY:"), skipped.value
    assert "pip install 'weightsync[oracle]'" in str(skipped.value), skipped.value


def test_a_missing_dependency_makes_the_verdict_undecided_naming_what_to_install():
    reason = "MISSING_DEPENDENCY: no independent forward: transformers is not installed (pip install 'weightsync[oracle]')"
    suite = {
        "complete": True,
        "exitstatus": 0,
        "tests": {
            "suites/conformance/test_bitwise.py::test_model[ipc-2rx]": {"status": "passed"},
            "suites/conformance/test_bitwise.py::test_fp8[ipc-2rx]": {"status": "not_supported"},
            NODE: {"status": "missing_dependency", "message": reason},
        },
    }
    decision = decide({"ipc": suite})
    assert decision.verdict == "COULD NOT DECIDE" and decision.exit_status == 3, decision
    assert decision.undecided == [
        f"conformance ipc: {NODE} could not run here: no independent forward: transformers is not "
        "installed (pip install 'weightsync[oracle]')"
    ], decision.undecided
    del suite["tests"][NODE]
    assert decide({"ipc": suite}).verdict == "PASS", "NOT_SUPPORTED alone leaves a PASS standing"


def test_the_plugin_records_a_missing_dependency_as_its_own_status(pytester):
    pytester.makepyfile(
        test_deps="""
        import pytest

        def test_needs_an_extra():
            pytest.skip("MISSING_DEPENDENCY: frobnicate is not installed (pip install 'weightsync[frob]')")

        def test_skips_for_its_own_reason():
            pytest.skip("an ordinary reason")
        """
    )
    results = pytester.path / "results.json"
    args = ("-p", "no:randomly", "-p", "no:cacheprovider", "--weightsync-backend=disk")
    run = pytester.runpytest_subprocess(*args, "--weightsync-receivers=1", f"--weightsync-results={results}")
    tests = json.loads(results.read_text())["tests"]
    records = {k.rsplit("::", 1)[-1]: v for k, v in tests.items()}
    assert records["test_needs_an_extra"]["status"] == "missing_dependency", records
    assert "pip install 'weightsync[frob]'" in records["test_needs_an_extra"]["message"], records
    assert records["test_skips_for_its_own_reason"]["status"] == "skipped", records
    assert run.ret == 0, run.stdout.str()[-2000:]
