"""What each suite showed, counted: per suite and backend (conformance and the fault matrix alike), and the
note that goes beside every fraction a page prints, so that a denominator never hides a NOT_SUPPORTED,
a skipped or an unknown point ("ok 4/5, 1 NOT_SUPPORTED")."""

from __future__ import annotations

import dataclasses
from collections import Counter

#: How the pages name each status of a results record, in the order a note lists them.
STATUS_NAMES = {
    "passed": "passed",
    "failed": "failed",
    "error": "error",
    "xpassed": "XPASS",
    "unknown": "unknown",
    "missing_dependency": "could not run",
    "not_supported": "NOT_SUPPORTED",
    "skipped": "skipped",
    "xfailed": "known failure",
}

#: A fault cell's verdicts as the pages name them (not_applicable: the backend does not claim what the
#: fault needs, the cell's NOT_SUPPORTED).
VERDICT_NAMES = {"ok": "ok", "fail": "fail", "unknown": "unknown", "not_applicable": "NOT_SUPPORTED"}

#: The columns of the counts table, each a sum of statuses (COUNT_COLUMNS[name] -> the statuses it adds).
COUNT_COLUMNS: dict[str, tuple[str, ...]] = {
    "passed": ("passed",),
    "failed": ("failed", "error", "xpassed"),
    "unknown": ("unknown", "missing_dependency"),
    "NOT_SUPPORTED": ("not_supported",),
    "skipped": ("skipped",),
    "known failures": ("xfailed",),
}


def rest_note(counts: Counter, shown: str, names: dict[str, str] = STATUS_NAMES) -> str:
    """', 1 NOT_SUPPORTED, 2 skipped': every status in `counts` but `shown` (the one the fraction counts),
    named as the pages name it; empty when the fraction's denominator holds nothing else."""
    rest = [f"{counts[s]} {names.get(s, s)}" for s in names if s != shown and counts.get(s)]
    rest += [f"{n} {s}" for s, n in counts.items() if s not in names and s != shown and n]
    return "".join(f", {r}" for r in rest)


@dataclasses.dataclass
class SuiteCount:
    """One suite run of one backend, counted: `statuses` as its results record holds them."""

    suite: str  # conformance, faults
    backend: str
    statuses: Counter
    examples: int | None  # hypothesis examples (conformance); None where the suite draws none

    @property
    def tests(self) -> int:
        return sum(self.statuses.values())

    def column(self, name: str) -> int:
        return sum(self.statuses[s] for s in COUNT_COLUMNS[name])


def statuses_of(run: dict) -> Counter:
    """The statuses of one suite run's tests (its results record's `tests`)."""
    return Counter(rec.get("status", "unknown") for rec in run.get("tests", {}).values())


def suite_counts(results: dict[str, dict], faults: dict[str, dict] | None = None) -> list[SuiteCount]:
    """Every suite run counted: conformance per backend, then the fault matrix per backend (the control
    column included)."""
    out = [
        SuiteCount(
            "conformance",
            b,
            statuses_of(res),
            sum(rec.get("examples", 0) for rec in res.get("tests", {}).values()),
        )
        for b, res in results.items()
    ]
    out += [SuiteCount("faults", b, statuses_of(res), None) for b, res in (faults or {}).items()]
    return out


def suite_total(counts: list[SuiteCount], suite: str) -> Counter:
    """The statuses of every backend's run of `suite`, added."""
    total: Counter = Counter()
    for c in counts:
        if c.suite == suite:
            total.update(c.statuses)
    return total


def count_rows(counts: list[SuiteCount]) -> list[list[str]]:
    """The counts table's cells (COUNT_HEADER), one row per suite run, in `counts`' order."""
    return [
        [
            c.suite,
            c.backend,
            str(c.tests),
            *(str(c.column(name)) for name in COUNT_COLUMNS),
            "–" if c.examples is None else str(c.examples),
        ]
        for c in counts
    ]


#: The counts table's header, as both pages head it.
COUNT_HEADER = ["suite", "backend", "tests", *COUNT_COLUMNS, "hypothesis examples"]
