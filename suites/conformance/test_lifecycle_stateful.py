"""Invariants 3 and 5 as a hypothesis state machine: the lifecycle, generation and pause/resume driven
in any order beside a small model of what the engines must then serve.

After every step: each engine serves the model's committed version, holds its weights bit for bit,
and is paused exactly when the model says so. Calls out of order get the error the model predicts.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fixtures.payloads import random_like_spec
from harness.api import (
    GenerationRequest,
    LifecycleError,
    ManifestMismatch,
    UnknownTensorError,
    VersionError,
    WeightSyncError,
)
from harness.checks import assert_bitwise_equal
from harness.deployment import deliver, transfer

READY, UPDATING, FAILED = "ready", "updating", "failed"
#: what a sender may raise in prepare for each bad kind of data (see _update)
SENDER_REFUSALS = {"unknown": UnknownTensorError, "bad_shape": ManifestMismatch}


def _expect(exc_type, fn, *args):
    """Run fn; it must raise exc_type (a WeightSyncError of another kind is a wrong answer)."""
    try:
        fn(*args)
    except exc_type:
        return
    except WeightSyncError as exc:
        raise AssertionError(
            f"{fn.__name__}{args!r} raised {type(exc).__name__}: {exc}; expected {exc_type.__name__}"
        ) from exc
    raise AssertionError(f"{fn.__name__}{args!r} succeeded; expected {exc_type.__name__}")


def make_machine(deployment, counter):
    class LifecycleMachine(RuleBasedStateMachine):
        """Model: committed version and weights, receiver state, staged version, paused flag."""

        @initialize()
        def fresh_engines(self):
            counter()
            deployment.reset(None)
            self.handles = deployment.handles
            self.spec = self.handles[0].engine.weight_spec()
            self.committed = 0
            self.weights = self.handles[0].engine.read_weights()
            self.state = READY
            self.staged: tuple[int, dict] | None = None
            self.paused = False
            self.pending = []
            self.seeds = itertools.count(1)
            self.request_ids = itertools.count()

        # ------------------------------------------------------------------ lifecycle
        @rule()
        def start(self):
            if self.state == UPDATING:
                for h in self.handles:
                    _expect(LifecycleError, h.receiver.start_weight_update)
                return
            for h in self.handles:
                h.receiver.start_weight_update()
            self.state, self.staged = UPDATING, None

        # Separate rules for the happy and the refused variants: rule choice is uniform, so each
        # variant is reached often (one rule with a sampled variant leans to its first value).
        @rule(step=st.sampled_from([1, 2]))
        def update(self, step):
            self._update(step, "good")

        @rule(step=st.sampled_from([0, -1]))
        def update_stale(self, step):
            self._update(step, "good")

        @rule(kind=st.sampled_from(["unknown", "bad_shape"]))
        def update_bad(self, kind):
            self._update(1, kind)

        def _update(self, step, kind):
            version = self.committed + step
            weights = random_like_spec(self.spec, seed=next(self.seeds))
            if kind == "unknown":
                weights["not.a.weight"] = torch.zeros(3)
            elif kind == "bad_shape":
                name = next(iter(weights))
                weights[name] = torch.zeros(1, dtype=weights[name].dtype)
            if self.state not in (UPDATING, FAILED):
                for h in self.handles:  # refused before the data plane, so no transmit
                    _expect(LifecycleError, h.receiver.update_weights, {"manifest": {}})
                return
            if self.state == FAILED:
                expected = LifecycleError
            elif version <= self.committed:
                expected = VersionError
            elif kind == "unknown":
                expected = UnknownTensorError
            elif kind == "bad_shape":
                expected = ManifestMismatch
            elif self.staged is not None:
                expected = VersionError if version != self.staged[0] else ManifestMismatch
            else:
                expected = None
            if expected is None:
                deliver(deployment, version, weights)
                self.staged = (version, weights)
                return
            # A sender may refuse what it can judge alone (an unknown name or a wrong shape, against the
            # model it syncs) in prepare, before the data plane: no receiver saw the version, so their
            # update stays as it was. Only the refusal the data deserves counts; anything else is wrong.
            try:
                update_info = deployment.sender.prepare(version, weights)
            except SENDER_REFUSALS.get(kind, ()):
                return
            _expect(expected, transfer, deployment, version, update_info)
            self.state, self.staged = FAILED, None

        @rule()
        def finish(self):
            self._finish(0)

        @rule(step=st.sampled_from([1, -1]))
        def finish_wrong_version(self, step):
            self._finish(step)

        def _finish(self, step):
            staged_version = self.staged[0] if self.staged else self.committed + 1
            version = staged_version + step
            if self.state in (READY, FAILED) or self.staged is None:
                for h in self.handles:
                    _expect(LifecycleError, h.receiver.finish_weight_update, version)
                if self.state == FAILED:
                    self.state = READY
                return
            if step != 0:
                for h in self.handles:
                    _expect(VersionError, h.receiver.finish_weight_update, version)
                return
            for h in self.handles:
                h.receiver.finish_weight_update(version)
            self.committed, self.weights = self.staged
            self.state, self.staged = READY, None

        @precondition(lambda self: self.state == READY)
        @rule(step=st.sampled_from([1, 1, 2]))
        def full_sync(self, step):
            """The happy path in one rule, so programs reach many committed versions."""
            self.start()
            self._update(step, "good")
            self._finish(0)

        @precondition(lambda self: self.state == READY)
        @rule(step=st.sampled_from([1, 2]))
        def stage(self, step):
            """Start and deliver, leaving the finish to a later rule (right or wrong version)."""
            self.start()
            self._update(step, "good")

        @rule()
        def abort(self):
            for h in self.handles:
                h.receiver.abort_weight_update()
            self.state, self.staged = READY, None

        @precondition(lambda self: self.state == UPDATING)
        @rule()
        def init_during_update(self):
            for h in self.handles:
                _expect(LifecycleError, h.receiver.init_transfer_engine, {})

        # ------------------------------------------------------------------ serving
        def _request(self, n=3):
            return GenerationRequest(f"sm-{next(self.request_ids)}", (1, 2, 3, 4, 5), n)

        @precondition(lambda self: not self.paused)
        @rule()
        def generate(self):
            for i, h in enumerate(self.handles):
                (c,) = h.engine.generate([self._request()])
                assert c.versions_seen == {self.committed}, (
                    f"engine {i}: tokens from versions {sorted(c.versions_seen)}, committed is {self.committed}"
                )

        @precondition(lambda self: not self.paused)
        @rule(mode=st.sampled_from(["abort", "wait", "keep"]))
        def pause(self, mode):
            for h in self.handles:
                h.engine.pause(mode)
            self.paused = True

        @precondition(lambda self: self.paused)
        @rule()
        def submit_while_paused(self):
            self.pending.append([h.engine.submit(self._request()) for h in self.handles])

        @precondition(lambda self: self.paused)
        @rule()
        def resume(self):
            for h in self.handles:
                h.engine.resume()
            self.paused = False
            for streams in self.pending:
                for i, s in enumerate(streams):
                    c = s.result(timeout=60)
                    assert c.finish_reason == "length" and c.versions_seen == {self.committed}, (
                        f"engine {i}: request sent while paused ended {c.finish_reason!r} with versions "
                        f"{sorted(c.versions_seen)}; expected a full run on version {self.committed}"
                    )
            self.pending = []

        # ------------------------------------------------------------------ invariants
        @invariant()
        def serves_committed_version(self):
            for i, h in enumerate(self.handles):
                assert h.engine.weight_version == self.committed, (
                    f"engine {i} serves version {h.engine.weight_version}, model says {self.committed}"
                )
                assert h.engine.is_paused == self.paused, (
                    f"engine {i} is_paused={h.engine.is_paused}, model {self.paused}"
                )

        @invariant()
        def holds_committed_weights(self):
            for i, h in enumerate(self.handles):
                assert_bitwise_equal(
                    self.weights, h.engine.read_weights(), f"engine {i} at version {self.committed}"
                )

        def teardown(self):
            for h in getattr(self, "handles", []):
                if self.paused:
                    h.engine.resume()
                h.receiver.abort_weight_update()

    return LifecycleMachine


@pytest.mark.not_quick  # 19 s a run on 2 cores (the not_quick marker: pytest_plugin)
def test_lifecycle_state_machine(weightsync_deployment, weightsync_example_counter):
    from hypothesis import settings

    machine = make_machine(weightsync_deployment, weightsync_example_counter)
    run_state_machine_as_test(machine, settings=settings(settings.default, stateful_step_count=30))


pytestmark = pytest.mark.single_receiver
