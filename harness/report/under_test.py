"""What was under test, per backend, from the suites' results records: every backend a suite ran on (the
fault matrix's control column included, which has no conformance run of its own), and the capabilities
each declared, as one table of capability × backend for the appendix."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class UnderTest:
    """One backend as its suite runs recorded it."""

    backend: str
    suites: list[str]
    engine: str
    receivers: str
    profile: str
    capabilities: dict

    @property
    def claims(self) -> str:
        """The capabilities it claims, in a few words ('buckets, ipc, multi_receiver (up to 8)')."""
        flags = [k for k, v in sorted(self.capabilities.items()) if v is True]
        if "multi_receiver" in flags and self.capabilities.get("max_receivers"):
            i = flags.index("multi_receiver")
            flags[i] = f"multi_receiver (up to {self.capabilities['max_receivers']})"
        return ", ".join(flags) or "none"


def under_test(results: dict[str, dict], faults: dict[str, dict] | None = None) -> list[UnderTest]:
    """Every backend a suite ran on, conformance's first, in the order the suites ran them."""
    faults = faults or {}
    out = []
    for b in [*results, *(b for b in faults if b not in results)]:
        runs = [
            (suite, runs[b]) for suite, runs in (("conformance", results), ("faults", faults)) if b in runs
        ]
        first = runs[0][1]
        out.append(
            UnderTest(
                b,
                [suite for suite, _ in runs],
                _engine_of(first, b),
                str(first.get("receivers", {}).get(b, "–")),
                str(first.get("hypothesis_profile", "–")),
                first.get("capabilities", {}).get(b, {}),
            )
        )
    return out


def _engine_of(run: dict, backend: str) -> str:
    """The engine a backend's tests ran on: the run's, unless the path delivers into one of its own."""
    own = run.get("own_engines", {}).get(backend)
    return own or str(run.get("engine", "–"))


def _cap_text(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "–"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    return str(value)


def capability_table(tested: list[UnderTest]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per capability any backend declared, one column per backend."""
    names = sorted({k for t in tested for k in t.capabilities})
    header = ["capability", *(t.backend for t in tested)]
    rows = [[name, *(_cap_text(t.capabilities.get(name, "–")) for t in tested)] for name in names]
    return header, rows
