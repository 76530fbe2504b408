"""vLLM's four-phase weight update as one small state machine that every receiver shares.

It says whether a call is legal now and raises the specific error when it is not; the receiver does
the work between the checks. One copy of the rules, so the reference paths and the vLLM adapter
cannot drift apart (suites/conformance/test_lifecycle_stateful.py models the same rules).

    NEW --init--> READY --start--> UPDATING --update(ok)--> UPDATING --finish(v)--> READY
                                       |  update refused                 ^
                                       v                                 |
                                     FAILED --start / abort / finish (refused)
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.api import JSON, LifecycleError, VersionError

NEW, READY, UPDATING, FAILED = "new", "ready", "updating", "failed"


class Lifecycle:
    """Where one receiver stands: its state, the version staged in the open update, why it failed."""

    def __init__(self) -> None:
        self.state = NEW
        self.version: int | None = None  # the version every part of the open update carries
        self.failure: str | None = None  # why the open update can no longer commit

    def to(self, state: str) -> None:
        self.state, self.version, self.failure = state, None, None

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    # ------------------------------------------------------------------ checks, one per call
    def check_init(self, init_info: JSON) -> None:
        if self.state == UPDATING:
            raise LifecycleError("init_transfer_engine during an update; finish it first")
        if not isinstance(init_info, Mapping):
            raise LifecycleError(f"init_info must be a mapping, got {type(init_info).__name__}")

    def check_start(self) -> None:
        """A failed update may be restarted (the receiver drops what it staged); an open one may not."""
        if self.state == NEW:
            raise LifecycleError("start_weight_update before init_transfer_engine")
        if self.state == UPDATING:
            raise LifecycleError("start_weight_update while an update is in progress")

    def check_update(self) -> None:
        if self.state not in (UPDATING, FAILED):
            raise LifecycleError(
                f"update_weights outside an update (state {self.state!r}); call start_weight_update"
            )

    def check_not_failed(self) -> None:
        """Before a part is looked at: a refused part poisons the rest of the update."""
        if self.failure:
            raise LifecycleError(f"this update already failed: {self.failure}")

    def check_same_version(self, version: int) -> None:
        """After the engine accepted the part's names and version: all parts are one version."""
        if self.version is not None and version != self.version:
            raise VersionError(f"update mixes versions {self.version} and {version}")

    def accepted(self, version: int) -> None:
        self.version = version

    def fail(self, exc: BaseException) -> None:
        """A refused part poisons the update: nothing staged may be committed until a new start."""
        self.state, self.failure = FAILED, str(exc)

    def check_finish(self, version: int) -> None:
        """Raise unless `version` may be committed now. Refusing a failed update also closes it."""
        if self.state == FAILED:
            failure = self.failure
            self.to(READY)
            raise LifecycleError(f"finish_weight_update({version}) after a failed update_weights: {failure}")
        if self.state != UPDATING:
            raise LifecycleError(f"finish_weight_update outside an update (state {self.state!r})")
        if self.version is None:
            raise LifecycleError(
                f"finish_weight_update({version}) with nothing received; call update_weights"
            )
        if version != self.version:
            raise VersionError(
                f"finish_weight_update({version}) but the staged tensors are version {self.version}"
            )

    def check_abort(self) -> None:
        if self.state == NEW:
            raise LifecycleError("abort_weight_update before init_transfer_engine")
