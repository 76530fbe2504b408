"""Checks shared by suites and reports; a failure says what was expected, what came, and where."""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Mapping

import torch

from harness.manifest import as_bytes, digests, digests_like, dtype_name


def first_difference(expected: torch.Tensor, got: torch.Tensor) -> str:
    """Describe the first element whose raw bits differ, with both values and bit patterns."""
    width = expected.element_size()
    a = as_bytes(expected).view(-1, width) if expected.numel() else as_bytes(expected)
    b = as_bytes(got).view(-1, width) if got.numel() else as_bytes(got)
    diff = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero()
    if not len(diff):
        return "no element differs"
    i = int(diff[0])
    n_diff = len(diff)
    flat_e, flat_g = expected.reshape(-1), got.reshape(-1)
    bits_e, bits_g = bytes(a[i].tolist())[::-1].hex(), bytes(b[i].tolist())[::-1].hex()
    return (
        f"{n_diff}/{expected.numel()} elements differ; first at flat index {i}: "
        f"expected {flat_e[i].float().item()!r} (0x{bits_e}), got {flat_g[i].float().item()!r} (0x{bits_g})"
    )


def _layout_problem(name: str, expected: torch.Tensor, got_dtype: str, got_shape) -> str | None:
    """The line for a tensor held with another dtype or shape than `expected`'s (None: the same)."""
    if got_dtype == dtype_name(expected.dtype) and tuple(got_shape) == tuple(expected.shape):
        return None
    return f"{name}: expected {tuple(expected.shape)} {dtype_name(expected.dtype)}, got {tuple(got_shape)} {got_dtype}"


def bitwise_mismatches(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """One line per tensor of `expected` that `got` lacks or does not hold bit for bit."""
    problems = []
    for name, e in expected.items():
        if name not in got:
            problems.append(f"{name}: missing from the engine")
            continue
        g = got[name]
        layout = _layout_problem(name, e, dtype_name(g.dtype), g.shape)
        if layout:
            problems.append(layout)
            continue
        e, g = e.cpu(), g.cpu()  # either side may live on a GPU
        if not torch.equal(as_bytes(e), as_bytes(g)):
            problems.append(f"{name} ({dtype_name(e.dtype)} {tuple(e.shape)}): {first_difference(e, g)}")
    return problems


def live_digests(engine) -> dict[str, list]:
    """The oracle's read of `engine`'s live weights as name -> [dtype, shape, digest] (ws64x2 on a GPU,
    xxh3 on the host: manifest.digests). Computed where the engine lives when it can say so (a rank's
    pipe proxy answers `live_digests` from the rank), so a read-back of gigabytes moves 16 bytes each."""
    remote = getattr(engine, "live_digests", None)
    return remote() if callable(remote) else digest_weights(engine.read_weights())


def digest_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """name -> [dtype, shape, digest] of tensors in this process (what live_digests answers)."""
    names = list(weights)
    sums = digests([weights[n] for n in names])
    return {
        n: [dtype_name(weights[n].dtype), list(weights[n].shape), d] for n, d in zip(names, sums, strict=True)
    }


def digest_mismatches(expected: Mapping[str, torch.Tensor], engine) -> list[str]:
    """bitwise_mismatches through digests (live_digests): one line per tensor of `expected` the engine
    lacks or holds with another dtype, shape or digest. For read-backs too large to copy out whole
    (throughput rows); the conformance suites compare the bytes themselves."""
    got = live_digests(engine)
    problems, names = [], []
    for name, e in expected.items():
        g = got.get(name)
        layout = f"{name}: missing from the engine" if g is None else _layout_problem(name, e, g[0], g[1])
        if layout:
            problems.append(layout)
        else:
            names.append(name)
    want = digests_like([expected[n] for n in names], [got[n][2] for n in names])
    problems += [
        f"{n} ({dtype_name(expected[n].dtype)} {tuple(expected[n].shape)}): digest {got[n][2]}, expected {w}"
        for n, w in zip(names, want, strict=True)
        if got[n][2] != w
    ]
    return problems


def assert_bitwise_equal(
    expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], context: str, rerun: str = ""
) -> None:
    problems = bitwise_mismatches(expected, got)
    if problems:
        lines = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        hint = f"\nrerun: {rerun}" if rerun else ""
        raise AssertionError(
            f"{context}: {len(problems)} tensor(s) not bitwise equal:\n  {lines}{more}{hint}"
        )


# ------------------------------------------------------------------------------------------ fault cells
@dataclasses.dataclass
class CellObservation:
    """What a fault cell's workload saw; `judge_cell` turns it into a verdict."""

    fault: object  # the harness.faults.injectors.Fault that was injected
    timeout_s: float
    versions: dict[
        int, dict[str, torch.Tensor]
    ]  # what the trainer pushed, by version (those that may be served)
    version: int = 2  # the push the fault struck
    recovery_version: int = 3  # the push after heal
    victim_name: str | None = None
    error: BaseException | None = None  # what the faulty push raised (None: it succeeded)
    detect_s: float = 0.0
    push_waited_s: float = 0.0  # what the push's threads waited for a CPU (a loaded host): added to its bound
    after_fault: list = dataclasses.field(
        default_factory=list
    )  # per engine: (version, weights) or "down: ..."
    recovery_error: BaseException | None = None
    recover_s: float = 0.0
    after_recovery: list = dataclasses.field(default_factory=list)
    fault_problems: list[str] = dataclasses.field(
        default_factory=list
    )  # the fault's own oracle (Fault.check)
    must_name: tuple[str, ...] = ()  # a failed push's error carries one of these (what was damaged)

    def error_text(self) -> str | None:
        return None if self.error is None else _error_text(self.error).strip()[-1500:]


#: What a writer prints on every failure of its kind, whatever was damaged: an error that carries only
#: these has said that something failed, not what. A fault's `must_name` word among them never counts
#: (lowercase; matched whole, so "segment wsync-1-ab removed" still names its segment).
STOCK_PHRASES = frozenset(
    {
        "no such file or directory",
        "no space left on device",
        "address already in use",
        "in use",
        "failed",
        "removed",
        "missing",
        "replaced",
        "foreign",
        "not found",
        "error",
    }
)


def damage_names(must_name) -> list[str]:
    """The words of `must_name` that name the damaged thing itself (its segment, directory, port,
    filesystem), without the stock phrases a writer prints on every failure."""
    return [w for w in must_name if w and w.strip().lower() not in STOCK_PHRASES]


def _error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc))


def _safety(engines: list, versions: dict[int, dict[str, torch.Tensor]], when: str) -> list[str]:
    """Every engine that serves holds exactly one committed version, bit for bit."""
    problems = []
    for i, state in enumerate(engines):
        if isinstance(state, str):
            continue  # a rank that is down serves nothing
        version, weights = state
        if version not in versions:
            if version != 0:
                problems.append(
                    f"{when}: engine {i} serves version {version}, which the trainer never pushed"
                )
            continue
        mismatches = bitwise_mismatches(versions[version], weights)
        if mismatches:
            problems.append(
                f"{when}: engine {i} claims version {version} but holds other bytes: {mismatches[0]}"
                + (f" (+{len(mismatches) - 1} more tensors)" if len(mismatches) > 1 else "")
            )
    return problems


def judge_cell(obs: CellObservation) -> tuple[str, list[str]]:
    """Jepsen's checker for one cell: ("ok" | "fail", reasons). Safety, bounded detection with a
    specific error, agreement across engines, then recovery to the newest version."""
    from harness.api import PartialCommitError, WeightSyncError

    problems = _safety(obs.after_fault, obs.versions, "after the fault")
    # a push that fails must say so within 2x the timeout; one that rides the fault out (a rank that
    # stalled in start is replaced, then the push goes on) is bounded by the cell's phase deadline
    # on a loaded host, the time the push's threads waited for a CPU is added (harness.deadline)
    if obs.error is not None and obs.detect_s > 2 * obs.timeout_s + obs.push_waited_s:
        load = (
            f" + {obs.push_waited_s:.1f}s its threads waited for a CPU" if obs.push_waited_s >= 0.05 else ""
        )
        problems.append(
            f"the faulty push took {obs.detect_s:.1f}s, over 2x the {obs.timeout_s:g}s timeout{load}"
        )
    served = [s[0] for s in obs.after_fault if not isinstance(s, str)]
    problems += obs.fault_problems
    if obs.error is not None and getattr(obs.fault, "must_succeed", False):
        problems.append(
            f"the push failed on a fault the client must ride out ({obs.fault.kind}: retried with the "
            f"same Idempotency-Key it succeeds): {_error_text(obs.error).strip()[:300]}"
        )
    if obs.error is None:
        if any(v != obs.version for v in served):
            problems.append(
                f"the push of version {obs.version} reported success while engines serve versions {served}"
            )
    else:
        text = _error_text(obs.error)
        injected_trainer = isinstance(obs.error, RuntimeError) and "injected trainer failure" in text
        if not isinstance(obs.error, WeightSyncError | MemoryError) and not injected_trainer:
            problems.append(f"the failure is not a specific error: {type(obs.error).__name__}: {text[:300]}")
        named = damage_names(obs.must_name)
        if obs.must_name and not any(w in text for w in named):
            problems.append(
                f"the error does not say what was damaged (none of {named[:4]}): {text.strip()[:300]}"
            )
        if getattr(obs.fault, "names_victim", False) and obs.victim_name and obs.victim_name not in text:
            problems.append(f"the error does not name the faulty receiver ({obs.victim_name}): {text[:300]}")
        if len(set(served)) > 1 and not isinstance(obs.error, PartialCommitError):
            problems.append(
                f"engines serve versions {served} after a failed push, and the error does not say so: "
                f"{type(obs.error).__name__}"
            )
        if isinstance(obs.error, PartialCommitError):
            said = [v for v in obs.error.versions if v is not None]
            if sorted(said) != sorted(served):
                problems.append(f"the error says engines serve {obs.error.versions}, they serve {served}")
    if obs.recovery_error is not None:
        problems.append(
            f"no recovery: the push of version {obs.recovery_version} after heal failed: "
            f"{_error_text(obs.recovery_error).strip()[:400]}"
        )
    else:
        down = [s for s in obs.after_recovery if isinstance(s, str)]
        late = [s[0] for s in obs.after_recovery if not isinstance(s, str) and s[0] != obs.recovery_version]
        if down or late:
            states = [s if isinstance(s, str) else s[0] for s in obs.after_recovery]
            problems.append(
                f"after recovery not every engine serves version {obs.recovery_version}: {states}"
            )
        problems += _safety(obs.after_recovery, obs.versions, "after recovery")
    return ("fail", problems) if problems else ("ok", [])
