"""Known failures of the code under test, from a file the user keeps: `--weightsync-xfails-file PATH`.

A framework that adopts the gate before its findings are fixed lists them here, one test per line, and
each becomes a strict xfail: reported as a known failure (never hidden, never skipped), and the day the
framework fixes it the XPASS fails the run, so the line must go. As array-api-tests' xfails file:

    # comments and blank lines are ignored
    suites/conformance/test_resources.py::test_nothing_grows_with_the_number_of_syncs  # deltas never pruned

An entry without parameters ("...::test_x") covers every parametrization of the test ("test_x[...]"); a '*'
stands for any characters ("...::test_x[*-BF16]": the bf16 variants of every backend and receiver count).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KnownFailure:
    nodeid: str
    reason: str
    line: int

    def covers(self, nodeid: str) -> bool:
        pattern = ".*".join(re.escape(part) for part in self.nodeid.split("*"))
        if "[" not in self.nodeid:
            pattern += r"(\[.*\])?"
        return re.fullmatch(pattern, nodeid) is not None


def read_known_failures(path: str | Path) -> list[KnownFailure]:
    """The file's entries; a line that names no test (no '::') raises ValueError naming the line."""
    entries = []
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        test, _, reason = raw.partition("#")
        test = test.strip()
        if not test:
            continue
        if "::" not in test or " " in test:
            raise ValueError(
                f"{path}:{number}: {raw.strip()!r} is not a test id (path.py::test_name[params])"
            )
        entries.append(KnownFailure(test, reason.strip() or f"listed in {path}:{number}", number))
    return entries


def known_failure_of(entries: list[KnownFailure], nodeid: str) -> KnownFailure | None:
    return next((e for e in entries if e.covers(nodeid)), None)
