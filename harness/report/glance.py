"""The report's first screen, as data both pages draw: the verdict, what each suite showed (counted), why
the verdict is what it is (its reasons, counted by where they came from, the first few in full), and what
to run next (the first rerun lines; for a PASS, the run again or the full run a --quick one stands for)."""

from __future__ import annotations

import dataclasses
import shlex
from collections import Counter

from harness.report.counts import COUNT_COLUMNS, suite_counts, suite_total
from harness.report.evidence import FAIL, PASS

#: Reasons and rerun lines the first screen shows in full; the rest are counted there and listed below.
FIRST_SCREEN_ITEMS = 5


@dataclasses.dataclass
class Glance:
    """What the first screen says. `shown`: one line per suite ("conformance: 376 tests on 5 backends:
    314 passed, 62 NOT_SUPPORTED"); `where`: (where, failed, undecided) per source of a reason;
    `reasons`: (failed | could not decide, text), the first FIRST_SCREEN_ITEMS; `reruns`: the first rerun
    commands; `next_steps`: (what, command) where nothing failed alone (a PASS, a suite that stopped)."""

    verdict: str
    label: str
    exit_status: int
    shown: list[str]
    where: list[tuple[str, int, int]]
    reasons: list[tuple[str, str]]
    more_reasons: int
    reruns: list[str]
    more_reruns: int
    next_steps: list[tuple[str, str]]

    @property
    def why(self) -> str:
        """'2 failed (conformance disk 1, throughput 1); 1 could not be decided (faults ipc 1)', or, for a
        PASS, what it rests on."""
        if self.verdict == PASS:
            return "nothing failed and nothing was left undecided (unknown is never counted as ok)."
        parts = []
        for i, kind in ((1, "failed"), (2, "could not be decided")):
            by = [(w[0], w[i]) for w in self.where if w[i]]
            total = sum(n for _, n in by)
            if total:
                parts.append(f"{total} {kind} ({', '.join(f'{w} {n}' for w, n in by)})")
        return "; ".join(parts) + "."


def where_of(reason: str) -> str:
    """Where a reason of decide() came from: 'conformance disk', 'faults ipc', 'throughput', or 'run'."""
    head, sep, _ = reason.partition(":")
    if sep and head.split(" ", 1)[0] in ("conformance", "faults"):
        return head
    return "throughput" if reason.startswith("throughput") else "run"


def _suite_line(suite: str, noun: str, total: Counter, backends: int) -> str:
    """'faults: 42 fault cells on 6 backend(s): 14 ok, 28 NOT_SUPPORTED' (every column that is not 0)."""
    ok = "passed" if suite == "conformance" else "ok"
    parts = [f"{sum(total[s] for s in COUNT_COLUMNS['passed'])} {ok}"]
    for column, statuses in COUNT_COLUMNS.items():
        n = sum(total[s] for s in statuses)
        if column != "passed" and n:
            parts.append(f"{n} {column}")
    return f"{suite}: {sum(total.values())} {noun} on {backends} backend(s): {', '.join(parts)}"


def shown_lines(results: dict, faults: dict, rows: list) -> list[str]:
    """One line per suite: how many tests (fault cells, throughput rows) and what they showed."""
    counts = suite_counts(results, faults)
    lines = []
    for suite, noun, runs in (("conformance", "tests", results), ("faults", "fault cells", faults)):
        if runs:
            lines.append(_suite_line(suite, noun, suite_total(counts, suite), len(runs)))
    gated = [r for r in rows if not r.swept]
    if gated:
        ok = sum(r.passed for r in gated)
        failed = len(gated) - ok
        lines.append(
            f"throughput: {len(gated)} row(s) on {len({r.path for r in gated})} path(s): {ok} within their "
            f"floors{f', {failed} failed' if failed else ''}"
        )
    return lines


def next_steps(data: dict, out_dir: str) -> list[tuple[str, str]]:
    """What to run where no rerun line covers it: a suite that stopped (resume the bundle), a PASS (the
    same run again), a --quick PASS (the full run)."""
    first = data["command"].split(" ; then ")[0]
    steps = []
    stopped = [r for r in data["reasons"]["undecided"] if where_of(r) != "run" and "unknown" not in r]
    if stopped:
        steps.append(
            (
                "finish what stopped (reuses every suite that finished)",
                f"{first} --resume {shlex.quote(out_dir)}",
            )
        )
    if data["verdict"] == PASS:
        if data.get("quick"):
            steps.append(("the full run this --quick one stands for", data["quick"]["full_command"]))
        steps.append(("this run again", first))
    return steps


def glance(data: dict, rows: list, out_dir: str) -> Glance:
    """The first screen of results.json's `data` (rows: the SyncRows it came from; out_dir: the bundle)."""
    reasons = [("failed", r) for r in data["reasons"]["failed"]]
    reasons += [("could not decide", r) for r in data["reasons"]["undecided"]]
    where: dict[str, list[int]] = {}
    for kind, r in reasons:
        where.setdefault(where_of(r), [0, 0])[0 if kind == "failed" else 1] += 1
    commands = [r["command"] for r in data["reruns"]]
    n = FIRST_SCREEN_ITEMS
    return Glance(
        verdict=data["verdict"],
        label=data.get("verdict_label", data["verdict"]),
        exit_status=data["exit_status"],
        shown=shown_lines(data["conformance"], data["faults"], rows),
        where=[(w, f, u) for w, (f, u) in where.items()],
        reasons=reasons[:n],
        more_reasons=max(0, len(reasons) - n),
        reruns=commands[:n],
        more_reruns=max(0, len(commands) - n),
        next_steps=next_steps(data, out_dir) if data["verdict"] != FAIL or not commands else [],
    )
