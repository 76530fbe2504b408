"""The layout the architecture relies on (docs/architecture.md), checked from the source.

The harness is what a user installs and runs against their own path; `fixtures/` is test-side data
(hypothesis strategies). Each rule is read from the import statements with `ast`, so it holds
whether or not the optional dependencies are installed.
"""

from __future__ import annotations

import ast
import re
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


def harness_modules() -> dict[str, Path]:
    """{dotted module name: file} for every module of harness/ (a package by its __init__)."""
    out = {}
    for path in sorted(HARNESS.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def layer_table(page: Path) -> list[tuple[str, list[str]]]:
    """[(layer, [harness module or package prefix])] from the table under "Layers", bottom first."""
    section = page.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        entries = re.findall(r"`(harness/[^`]*)`", cells[1]) if len(cells) == 3 else []
        if entries:
            layers.append((cells[0], [e.removesuffix(".py").rstrip("/").replace("/", ".") for e in entries]))
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> list[int]:
    """The rows whose entry is `module` or a package holding it (the longest entry wins)."""
    hits = [
        (len(e), i)
        for i, (_, entries) in enumerate(layers)
        for e in entries
        if module == e or module.startswith(e + ".")
    ]
    longest = max((n for n, _ in hits), default=0)
    return sorted({i for n, i in hits if n == longest})


def import_graph() -> dict[str, set[str]]:
    """{harness module: the harness modules it imports}, each import resolved to the longest module name."""
    modules = harness_modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in imported_modules(path):
            parts = imported.split(".")
            for n in range(len(parts), 0, -1):
                candidate = ".".join(parts[:n])
                if candidate in modules:
                    if candidate != name:
                        deps.add(candidate)
                    break
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_harness_module_is_in_one_layer_of_the_architecture_page():
    layers = layer_table(ROOT / "docs" / "architecture.md")
    placed = {m: layer_of(m, layers) for m in harness_modules() if m != "harness"}
    unplaced = sorted(m for m, rows in placed.items() if not rows)
    twice = {m: [layers[i][0] for i in rows] for m, rows in placed.items() if len(rows) > 1}
    assert not unplaced and not twice, (
        f"docs/architecture.md's layer table must place every harness module once: not placed {unplaced}; "
        f"placed twice {twice}. Add the module (or its package, harness/x/) to its row. "
        "Rerun: python -m pytest suites/meta/test_layout.py -k layer"
    )


def test_no_module_imports_a_layer_above_its_own():
    layers = layer_table(ROOT / "docs" / "architecture.md")
    up = []
    for module, deps in import_graph().items():
        mine = layer_of(module, layers)
        for dep in sorted(deps):
            theirs = layer_of(dep, layers)
            if mine and theirs and theirs[0] > mine[0]:
                up.append(f"{module} ({layers[mine[0]][0]}) -> {dep} ({layers[theirs[0]][0]})")
    assert not up, (
        f"imports up the layers of docs/architecture.md: {up}; move the shared piece down a layer, or pass "
        "it in from above. Rerun: python -m pytest suites/meta/test_layout.py -k layer"
    )


def test_no_import_cycles_in_the_harness():
    found = cycles(import_graph())
    assert not found, (
        f"modules that import each other (directly or round a loop): {found}; the shared part belongs in a "
        "module both import. Rerun: python -m pytest suites/meta/test_layout.py -k cycles"
    )


def test_the_layout_checks_catch_a_cycle_and_an_import_up():
    """The checks above are only as good as their reading of the graph: a made-up graph with a loop and a
    table with an upward import must be seen."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    layers = [("low", ["harness.api"]), ("high", ["harness.report"])]
    assert layer_of("harness.report.bundle", layers) == [1] and layer_of("harness.api", layers) == [0]
    assert layer_of("harness.cli", layers) == []


#: Over this many lines a module says at its top why it is one file (issue 29: a newcomer reads it in 10 minutes).
LONG_FILE_LINES = 600


def test_a_file_over_600_lines_says_at_its_top_why_it_is_one_file():
    unexplained = {}
    for path in sorted(
        [*HARNESS.rglob("*.py"), *(ROOT / "suites").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]
    ):
        lines = path.read_text().splitlines()
        if len(lines) > LONG_FILE_LINES and not any("Why one file:" in line for line in lines[:60]):
            unexplained[str(path.relative_to(ROOT))] = len(lines)
    assert not unexplained, (
        f"files over {LONG_FILE_LINES} lines without a 'Why one file:' sentence in their first 60 lines: "
        f"{unexplained}; split the file, or say why it is one. Rerun: python -m pytest suites/meta/test_layout.py"
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
