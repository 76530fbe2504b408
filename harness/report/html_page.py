"""report.html: the certification on one self-contained page (inline CSS, plots as data URIs, no links out),
drawn from the same data as results.json so that the two can never disagree."""

from __future__ import annotations

import base64
import html
from collections import Counter
from pathlib import Path

from harness.bench import THROUGHPUT_COLUMNS, throughput_cells
from harness.report.evidence import (
    RESHARD_COLUMNS,
    between_syncs_kinds,
    cell,
    damage_of,
    fault_cell_text,
    fault_matrix,
    jobs_text,
    known_failures,
    matrix,
    quick_throughput,
    reshard_bytes_rows,
    reshard_heading,
    reshard_plans,
)

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:13px} th,td{border:1px solid #ccc;padding:3px 7px}
th{background:#f3f3f3} td.num{text-align:right;font-variant-numeric:tabular-nums}
.PASS,.ok{color:#11772b;font-weight:600} .FAIL,.fail{color:#b00020;font-weight:700}
.UNDECIDED,.unknown{color:#a15c00;font-weight:700} .ns{color:#777}
.verdict{font-size:2em;padding:.2em .5em;border-radius:6px;display:inline-block}
.verdict.PASS{background:#e5f6e9} .verdict.FAIL{background:#fde8eb} .verdict.UNDECIDED{background:#fff3df}
code,pre{background:#f6f6f6;font:12px ui-monospace,monospace} pre{padding:.6em;overflow-x:auto;white-space:pre-wrap}
img{max-width:100%;border:1px solid #eee}
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _verdict_class(verdict: str) -> str:
    return "UNDECIDED" if verdict == "COULD NOT DECIDE" else verdict


def _cell_html(text: str) -> str:
    """A matrix cell of the Markdown report (`**FAIL** 1/3`, `PASS 3/3`, `NOT_SUPPORTED`), coloured."""
    plain = text.replace("**", "")
    first = plain.split(" ", 1)[0]
    css = {"FAIL": "fail", "PASS": "ok", "ok": "ok", "unknown": "unknown", "NOT_SUPPORTED": "ns"}.get(
        first, ""
    )
    return f'<td class="{css}">{_e(plain)}</td>'


def _table(header: list[str], rows: list[list[str]], numeric_from: int = 99) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = ""
    for row in rows:
        tds = "".join(
            c if c.startswith("<td") else f"<td{' class=num' if i >= numeric_from else ''}>{_e(c)}</td>"
            for i, c in enumerate(row)
        )
        body += f"<tr>{tds}</tr>"
    return f"<table><tr>{head}</tr>{body}</table>"


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
        "<h2>Skipped by --quick</h2>",
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


def render(data: dict, rows: list, out_dir: Path) -> str:
    """The page for results.json's `data` (with the SyncRows it came from; plots read from out_dir)."""
    results, faults, env = data["conformance"], data["faults"], data["environment"]
    verdict = data["verdict"]
    label = data.get("verdict_label", verdict)
    vclass = _verdict_class(verdict)
    jobs = data.get("jobs", 1)  # a bundle from before --jobs ran one test at a time
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>weightsync certification: {_e(label)}</title><style>{CSS}</style></head><body>",
        "<h1>weightsync certification</h1>",
        f'<div class="verdict {vclass}">{_e(label)}</div>',
        f"<p>exit status {data['exit_status']} (0 PASS, 1 FAIL, 3 COULD NOT DECIDE) · run "
        f"<code>{_e(data['run_id'])}</code> · generated {_e(data['generated_at'])}</p>",
        f"<p>command: <code>{_e(data['command'])}</code></p>",
        f"<p>{_e(jobs_text(jobs))}</p>",
    ]
    reasons = data["reasons"]
    if reasons["failed"] or reasons["undecided"]:
        items = [f'<li><span class="fail">failed</span> {_e(r)}</li>' for r in reasons["failed"]]
        items += [
            f'<li><span class="unknown">could not decide</span> {_e(r)}</li>' for r in reasons["undecided"]
        ]
        parts += ["<h2>Why</h2><ul>", *items, "</ul>"]
    if data["reruns"]:
        parts += ["<h2>Rerun a failure alone</h2><p>From the repository root:</p><ul>"]
        parts += [
            f"<li>{_e(r['suite'])} {_e(r['what'])}<pre>{_e(r['command'])}</pre></li>" for r in data["reruns"]
        ]
        parts += ["</ul>"]

    parts += _quick_parts(data.get("quick"))
    backends = list(results)
    parts.append("<h2>What was under test</h2>")
    parts.append(
        _table(
            ["backend", "engine", "receivers", "hypothesis profile", "capabilities"],
            [
                [
                    b,
                    str(results[b].get("engine", data["engine"])),
                    str(results[b].get("receivers", {}).get(b, data["receivers"])),
                    str(results[b].get("hypothesis_profile", data["seeds"]["hypothesis_profile"])),
                    ", ".join(f"{k}={v}" for k, v in results[b].get("capabilities", {}).get(b, {}).items()),
                ]
                for b in backends
            ],
        )
    )

    mat = matrix(results)
    parts.append("<h2>Invariants × paths</h2>")
    parts.append(
        _table(
            ["invariant", *backends],
            [[inv] + [_cell_html(cell(mat[inv].get(b))) for b in backends] for inv in sorted(mat)],
        )
    )
    failures = [
        (b, n, rec)
        for b in backends
        for n, rec in results[b].get("tests", {}).items()
        if rec.get("status") in ("failed", "error")
    ]
    if failures:
        parts.append("<h2>Failures</h2>")
        for b, n, rec in failures:
            parts.append(
                f"<h3>{_e(b)}: <code>{_e(n)}</code></h3><pre>{_e(rec.get('message', '')[-3000:])}</pre>"
            )

    fmat = fault_matrix(faults)
    if fmat:
        fbackends = list(faults)
        parts.append("<h2>Fault matrix</h2>")
        parts.append(
            "<p>ok / fail / unknown (never ok) / NOT_SUPPORTED per cell; times: slowest faulty push (detect) "
            "/ slowest push after heal (recover).</p>"
        )
        between = between_syncs_kinds(fmat)
        parts.append(
            _table(
                ["fault", *fbackends],
                [
                    [k] + [_cell_html(fault_cell_text(fmat[k].get(b))) for b in fbackends]
                    for k in fmat
                    if k not in between
                ],
            )
        )
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

    known = known_failures(results, faults)
    if known:
        parts.append("<h2>Known failures</h2>")
        parts.append(
            "<p>Listed in the xfails file: they failed as expected (a fix shows as XPASS, which fails "
            "the verdict until the line goes).</p>"
        )
        parts.append(
            _table(
                ["backend", "test", "reason"],
                [[b, n, r.removeprefix("known failure: ")] for b, n, r in known],
            )
        )

    counts = {b: Counter(rec.get("status") for rec in results[b].get("tests", {}).values()) for b in backends}
    parts.append("<h2>Counts</h2>")
    parts.append(
        _table(
            ["backend", "tests", "passed", "failed", "NOT_SUPPORTED", "skipped", "unknown"],
            [
                [
                    b,
                    str(sum(c.values())),
                    str(c["passed"]),
                    str(c["failed"] + c["error"]),
                    str(c["not_supported"]),
                    str(c["skipped"]),
                    str(c["unknown"]),
                ]
                for b, c in counts.items()
            ],
            numeric_from=1,
        )
    )

    parts += _reshard_parts(results)

    if rows or data.get("throughput_note"):
        parts.append("<h2>Sync throughput</h2>")
        if data.get("throughput_note"):
            parts.append(f"<p><strong>{_e(data['throughput_note'])}</strong></p>")
    if rows:
        parts.append(
            "<p>Full lifecycle per push, median of repeats; algbw = bytes / time; ceiling = the raw transport "
            "on this machine; ratio = algbw / ceiling; verified = the ceiling plus the harness's digests; a row "
            "fails over allowed = the fixed cost allowed + the verified time / the bandwidth floor; #wrong = "
            "tensors not bitwise equal (must be 0). docs/performance.md explains every column.</p>"
        )
        body = []
        for r in rows:
            *cells, verdict = throughput_cells(r)
            css = "fail" if not r.passed else "ok" if verdict == "ok" else "unknown"
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
        parts.append(_image(out_dir / "throughput.png", "throughput"))
        parts.append(_image(out_dir / "breakdown.png", "where the time goes"))

    parts.append("<h2>Environment</h2>")
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
    parts.append(_table(["", "value"], [[k, str(v)] for k, v in env_rows]))
    seeds = data["seeds"]
    parts.append("<h2>Seeds</h2>")
    parts.append(
        _table(
            ["", "value"],
            [
                ["hypothesis profile", str(seeds["hypothesis_profile"])],
                ["fault seeds", ", ".join(map(str, seeds["fault_seeds"])) or "–"],
                ["throughput payload seed", str(seeds["payload_seed"])],
            ],
        )
    )
    parts.append(f"<h2>Command</h2><pre>{_e(data['command'])}</pre>")
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _reshard_parts(results: dict) -> list[str]:
    """The resharding plans test_reshard attached: bytes per rank against the minimum, every transfer."""
    plans = reshard_plans(results)
    if not plans:
        return []
    parts = [
        "<h2>Resharding plan</h2>",
        "<p>Trainer FSDP2 / DTensor shards → engine tensor-parallel shards (docs/resharding.md). minimum = "
        "the checkpoint bytes each engine rank's shards hold (total: their sum); measured = what the sync "
        "counted.</p>",
    ]
    for backend, node, plan in plans:
        parts.append(f"<h3><code>{_e(node)}</code> ({_e(backend)})</h3><p>{_e(reshard_heading(plan))}</p>")
        body = [
            [*cells[:4], f'<td class="{"ok" if cells[4] in ("ok", "-") else "fail"}">{_e(cells[4])}</td>']
            for cells in reshard_bytes_rows(plan)
        ]
        parts.append(_table(["rank", "planned B", "minimum B", "measured B", "measured = minimum"], body, 1))
        transfers = [[str(i)] + [str(t[c]) for c in RESHARD_COLUMNS] for i, t in enumerate(plan["transfers"])]
        parts.append(_table(["#", *RESHARD_COLUMNS], transfers))
        tied = [
            f"<li>tied: <code>{_e(a)}</code> is <code>{_e(b)}</code></li>"
            for a, b in plan.get("tied", {}).items()
        ]
        if tied:
            parts += ["<ul>", *tied, "</ul>"]
    return parts


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
