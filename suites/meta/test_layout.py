"""The layout the architecture relies on (docs/architecture.md), checked from the source.

The harness is what a user installs and runs against their own path; `fixtures/` is test-side data
(hypothesis strategies). Each rule is read from the import statements with `ast`, so it holds
whether or not the optional dependencies are installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "harness"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included), absolute names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def offending_imports(files, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """{file: [imported modules under one of `forbidden`]} for the files that break the rule."""
    out = {}
    for path in files:
        bad = sorted(
            m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in forbidden)
        )
        if bad:
            out[str(path.relative_to(ROOT))] = bad
    return out


def test_harness_imports_nothing_from_fixtures():
    offenders = offending_imports(sorted(HARNESS.rglob("*.py")), ("fixtures",))
    assert not offenders, (
        f"harness/ must not import the test-side fixtures/ package (fixtures -> harness is fine): "
        f"{offenders}; move what the harness needs into harness/. Rerun: "
        f"python -m pytest suites/meta/test_layout.py"
    )


def test_paths_hold_only_the_transport():
    """A path module is the transport (sender, receiver, codec) that rank processes import; wiring it
    into a deployment is harness/backends/'s job, so the launch machinery stays out of the data plane."""
    forbidden = ("harness.launch", "harness.deployment", "harness.backends")
    offenders = offending_imports(sorted((HARNESS / "paths").rglob("*.py")), forbidden)
    assert not offenders, (
        f"harness/paths/ must import none of {forbidden}: {offenders}; a Backend and its factory "
        f"belong in harness/backends/. Rerun: python -m pytest suites/meta/test_layout.py"
    )


def documented_invariants(page: Path) -> dict[str, str]:
    """{suite module: invariant name} from the table under "Invariant names in the report"."""
    rows: dict[str, str] = {}
    in_section = False
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            in_section = line.strip("# ").lower() == "invariant names in the report"
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if in_section else []
        if len(cells) == 2 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_architecture_page_names_the_reports_invariants():
    from harness.report import INVARIANTS

    page = ROOT / "docs" / "architecture.md"
    documented = documented_invariants(page)
    missing_from_page = {m: n for m, n in INVARIANTS.items() if documented.get(m) != n}
    missing_from_report = {m: n for m, n in documented.items() if INVARIANTS.get(m) != n}
    assert not missing_from_page and not missing_from_report, (
        f"docs/architecture.md's invariant table and harness.report.INVARIANTS differ: "
        f"in the report but not on the page (or named otherwise there): {missing_from_page}; "
        f"on the page but not in the report: {missing_from_report}. Rerun: "
        f"python -m pytest suites/meta/test_layout.py -k invariants"
    )
