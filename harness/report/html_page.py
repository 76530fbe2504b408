"""report.html: the certification on one self-contained page (inline CSS, plots as data URIs; its only links
are to its own sections and to the bundle's files beside it), drawn from the same data as results.json so
that the two can never disagree. The first screen and the appendix are html_sections'."""

from __future__ import annotations

import base64
from pathlib import Path

from harness.bench import THROUGHPUT_COLUMNS, throughput_cells
from harness.report.evidence import (
    between_syncs_kinds,
    cell,
    damage_of,
    fault_cell_text,
    fault_matrix,
    jobs_text,
    known_failures,
    matrix,
    quick_throughput,
)
from harness.report.glance import Glance, glance
from harness.report.html_parts import CSS, h2
from harness.report.html_parts import cell_html as _cell_html
from harness.report.html_parts import e as _e
from harness.report.html_parts import table as _table
from harness.report.html_parts import verdict_class as _verdict_class
from harness.report.html_sections import (
    appendix_parts,
    counts_parts,
    first_screen,
    floors_parts,
    full_lists,
    invariant_legend,
    under_test_parts,
)
from harness.report.sections import SECTIONS, slug


def _image(path: Path, alt: str) -> str:
    if not path.exists():
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<p><img alt="{_e(alt)}" src="data:image/png;base64,{data}"></p>'


def _quick_parts(quick: dict | None) -> list[str]:
    """'Skipped by --quick': what a first look left out, by suite and backend, and the full run's command."""
    if not quick:
        return []
    skipped = quick["skipped"]
    backends = sorted({b for by in skipped.values() for b in by})
    return [
        h2("quick"),
        "<p>A first look: the conformance tests that take a second or more on a 2-core machine (marked "
        "<code>not_quick</code>), the tests of each backend at more receivers than its fewest, and every "
        "fault cell past its fault's first point (in the control column, also the faults of its data plane: "
        "disk's column has them) were left out"
        f"{_e(quick_throughput(quick))}. {_e(quick['total'])} tests in all were not run (their node ids: "
        "results.json, <code>quick.skipped</code>). The full run:</p>",
        f"<pre>{_e(quick['full_command'])}</pre>",
        _table(
            ["backend", "conformance tests left out", "fault cells left out"],
            [
                [b, str(len(skipped["conformance"].get(b, []))), str(len(skipped["faults"].get(b, [])))]
                for b in backends
            ],
            numeric_from=1,
        ),
    ]


def render(data: dict, rows: list, out_dir: Path, g: Glance | None = None) -> str:
    """The page for results.json's `data` (with the SyncRows it came from; plots read from out_dir; `g`:
    its first screen, computed from `data` where not given)."""
    g = g or glance(data, rows, str(out_dir))
    results, faults, env = data["conformance"], data["faults"], data["environment"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>weightsync certification: {_e(g.label)}</title><style>{CSS}</style></head><body><main>",
        *first_screen(g, data),
        f"<p>command: <code>{_e(data['command'])}</code> · {_e(jobs_text(data.get('jobs', 1)))}</p>",
        *full_lists(data, g),
        *_quick_parts(data.get("quick")),
        *under_test_parts(results, faults),
    ]
    backends = list(results)
    mat = matrix(results)
    if mat:
        parts.append(h2("invariants"))
        rows_ = [[inv] + [_cell_html(cell(mat[inv].get(b))) for b in backends] for inv in sorted(mat)]
        parts += [_table(["invariant", *backends], rows_), invariant_legend()]
    failures = [
        (b, n, rec)
        for b in backends
        for n, rec in results[b].get("tests", {}).items()
        if rec.get("status") in ("failed", "error")
    ]
    if failures:
        parts.append(h2("failures"))
        for b, n, rec in failures:
            parts.append(
                f"<h3>{_e(b)}: <code>{_e(n)}</code></h3><pre>{_e(rec.get('message', '')[-3000:])}</pre>"
            )
    parts += _known_parts(results, faults)
    parts += _fault_parts(faults)
    parts += counts_parts(results, faults)
    parts += _throughput_parts(data, rows, out_dir)
    parts += _environment_parts(data, env)
    parts += appendix_parts(results, faults)
    parts.append("</main></body></html>")
    return "\n".join(p for p in parts if p)


def _known_parts(results: dict, faults: dict) -> list[str]:
    known = known_failures(results, faults)
    if not known:
        return []
    return [
        h2("known"),
        "<p>Listed in the xfails file: they failed as expected (a fix shows as XPASS, which fails "
        "the verdict until the line goes).</p>",
        _table(
            ["backend", "test", "reason"], [[b, n, r.removeprefix("known failure: ")] for b, n, r in known]
        ),
    ]


def _fault_parts(faults: dict) -> list[str]:
    fmat = fault_matrix(faults)
    if not fmat:
        return []
    fbackends = list(faults)
    between = between_syncs_kinds(fmat)
    parts = [
        h2("faults"),
        "<p>ok / fail / unknown (never ok) / NOT_SUPPORTED per cell, as a fraction of the cells (one per point "
        "the fault was injected at) with what else it holds (NOT_SUPPORTED: a point whose needs the backend "
        "does not claim); times: slowest faulty push (detect) / slowest push after heal (recover).</p>",
        _table(
            ["fault", "what is injected", *fbackends],
            [
                [k, damage_of(k)] + [_cell_html(fault_cell_text(fmat[k].get(b))) for b in fbackends]
                for k in fmat
                if k not in between
            ],
        ),
    ]
    if between:
        parts.append("<h3>Damage between syncs</h3>")
        parts.append(
            "<p>Damage done after v1 committed, nothing in flight; ok = the next push commits bit for bit, "
            "or fails once naming what was damaged and the push after it commits (no redeploy).</p>"
        )
        parts.append(
            _table(
                ["damage", "what is damaged", *fbackends],
                [
                    [k, damage_of(k)] + [_cell_html(fault_cell_text(fmat[k].get(b))) for b in fbackends]
                    for k in between
                ],
            )
        )
    return parts


def _throughput_parts(data: dict, rows: list, out_dir: Path) -> list[str]:
    parts = []
    if rows or data.get("throughput_note"):
        parts.append(h2("throughput"))
        if data.get("throughput_note"):
            parts.append(f"<p><strong>{_e(data['throughput_note'])}</strong></p>")
    if not rows:
        return parts
    parts.append(
        "<p>Full lifecycle per push, median of repeats; rx = receiver ranks, count = tensors, type = their "
        "dtype; algbw = bytes / time; ceiling = the raw transport on this machine (bound: its kind); ratio = "
        "algbw / ceiling; verified = the ceiling plus the harness's digests; a row fails over allowed = the "
        "fixed cost allowed + the verified time / the bandwidth floor; #wrong = tensors not bitwise equal "
        "(must be 0). docs/performance.md explains every column; each path's floors and why: "
        f'<a href="#{slug(SECTIONS["floors"])}">{_e(SECTIONS["floors"])}</a>.</p>'
    )
    body = []
    for r in rows:
        *cells, verdict = throughput_cells(r)
        css = (
            "unknown"
            if verdict == "host busy"
            else "fail"
            if not r.passed
            else "ok"
            if verdict == "ok"
            else "unknown"
        )
        body.append([*cells, f'<td class="{css}">{_e(verdict)}</td>'])
    parts.append(_table(list(THROUGHPUT_COLUMNS), body, numeric_from=1))
    from harness.throughput_model import FIT_COLUMNS, fit_cells, fit_paths

    fits = fit_paths(rows)
    if fits:
        parts.append("<h3>Fixed cost and bandwidth</h3>")
        parts.append(
            "<p>Each path's time fitted as fixed + bytes / bandwidth over its sizes; the bandwidth "
            "against the verified ceiling's, the fixed cost against what the path may cost per sync.</p>"
        )
        fit_body = []
        for fit in fits:
            *cells, verdict = fit_cells(fit)
            css = "ok" if verdict == "ok" else "fail" if fit.failures() else "unknown"
            fit_body.append([*cells, f'<td class="{css}">{_e(verdict)}</td>'])
        parts.append(_table(list(FIT_COLUMNS), fit_body, numeric_from=1))
    parts += floors_parts(rows)
    parts.append(_image(out_dir / "throughput.png", "throughput"))
    parts.append(_image(out_dir / "breakdown.png", "where the time goes"))
    return parts


def _environment_parts(data: dict, env: dict) -> list[str]:
    env_rows = [
        ["host", env.get("host")],
        ["platform", env.get("platform")],
        ["python", env.get("python")],
        ["torch", env.get("torch")],
        ["vllm", env.get("vllm") or "not installed"],
        ["CPU", f"{env.get('cpu_model')} × {env.get('cpus')}"],
        ["GPU", ", ".join(env.get("gpus") or []) or "none (torch.cuda not available)"],
        ["NCCL", env.get("nccl") or "–"],
    ]
    seeds = data["seeds"]
    seed_rows = [
        ["hypothesis profile", str(seeds["hypothesis_profile"])],
        ["fault seeds", ", ".join(map(str, seeds["fault_seeds"])) or "–"],
        ["throughput payload seed", str(seeds["payload_seed"])],
    ]
    return [
        h2("environment"),
        _table(["", "value"], [[k, str(v)] for k, v in env_rows]),
        "<h3>Seeds</h3>",
        _table(["", "value"], seed_rows),
        f"<h3>Command</h3><pre>{_e(data['command'])}</pre>",
    ]


def render_validate_cluster(report: dict) -> str:
    """validate-cluster.html: the verdict, why, the setup and every measurement, from validate-cluster.json's
    own data (the same page style as report.html; self-contained)."""
    verdict = report["verdict"]
    floor = report.get("floor_gbs")
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>weightsync validate-cluster: {_e(verdict)}</title><style>{CSS}</style></head><body>",
        "<h1>weightsync validate-cluster</h1>",
        f'<div class="verdict {_verdict_class(verdict)}">{_e(verdict)}</div>',
        f"<p>command: <code>{_e(report.get('command', ''))}</code></p>",
    ]
    if report["reasons"]:
        parts += [
            "<h2>Why</h2><ul>",
            *(f'<li><span class="fail">failed</span> {_e(r)}</li>' for r in report["reasons"]),
        ]
        parts.append("</ul>")
    rating = report.get("rating_gbps")
    setup = [
        ["world size", str(report["world_size"])],
        ["trainer ranks", ", ".join(map(str, report["trainer_ranks"]))],
        ["rollout groups", " | ".join(",".join(map(str, g)) for g in report["rollout_groups"])],
        ["rating", f"{rating:g} Gb/s" if rating else "none: p2p links judged against their peers' median only"],
        ["floor", f"{floor:.3f} GB/s of payload" if floor is not None else "none"],
        ["collective timeout", f"{report.get('timeout_s', 0):g} s"],
        ["smoke", f"{report.get('smoke_s', 0):.1f} s; missing ranks: {report.get('missing_ranks') or 'none'}"],
    ]  # fmt: skip
    parts += ["<h2>Setup</h2>", _table(["", ""], setup)]
    rows = []
    for link in report["links"]:
        slow = floor is not None and link["gbs"] < floor
        rows.append(
            [
                link["kind"], str(link["src"]), ",".join(map(str, link["dst"])), link["ends"],
                f"{link['size_bytes'] / 2**20:g}", f"{link['time_s'] * 1e3:.3f}", f"{link['gbs']:.3f}",
                '<td class="ns">no rating</td>' if floor is None else
                '<td class="fail">below floor</td>' if slow else '<td class="ok">ok</td>',
            ]
        )  # fmt: skip
    parts.append("<h2>Links</h2>")
    parts.append(
        _table(
            ["kind", "src", "dst", "ends", "size (MiB)", "time (ms)", "GB/s", "floor"], rows, numeric_from=4
        )
    )
    parts.append(
        "<p>GB/s: bytes moved / the fastest repeat's time, barrier to barrier (every party finished). "
        "A link is judged at its largest size.</p></body></html>"
    )
    return "".join(parts)
