"""The report's sections, titled once: report.md's headings, report.html's headings and ids, and every link
between them are read from this table, so a link can only point at a section that both pages head alike."""

from __future__ import annotations

import re

#: key -> title, in the order the pages print them (a page leaves out what it has nothing for).
SECTIONS: dict[str, str] = {
    "why": "Why, in full",
    "reruns": "Rerun each failure alone",
    "quick": "Skipped by --quick",
    "under_test": "What was under test",
    "invariants": "Invariants × paths",
    "failures": "Failures",
    "known": "Known failures",
    "faults": "Fault matrix",
    "counts": "Counts",
    "throughput": "Sync throughput",
    "floors": "Floors",
    "cost": "Cost model",
    "environment": "Environment",
    "capabilities": "Appendix A: capabilities",
    "reshard": "Appendix B: resharding plan",
}

#: The resharding plan's every transfer: a file of its own beside report.md (it runs to a line per transfer).
RESHARD_FILE = "reshard-plan.md"


def slug(title: str) -> str:
    """The anchor GitHub gives a Markdown heading (lower case, punctuation dropped, spaces to hyphens);
    report.html gives its headings the same ids."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchor(key: str) -> str:
    """'#fault-matrix': the link to a section by its key."""
    return "#" + slug(SECTIONS[key])


def md_link(key: str, text: str | None = None) -> str:
    """A Markdown link to a section: '[Fault matrix](#fault-matrix)'."""
    return f"[{text or SECTIONS[key]}]({anchor(key)})"
