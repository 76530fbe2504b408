"""What every page of the report draws with: the style sheet, escaping, tables (each in a box of its own
that scrolls sideways, so no table widens the page) and section headings with the ids the links use."""

from __future__ import annotations

import html

from harness.report.sections import SECTIONS, slug

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
.scroll{overflow-x:auto;max-width:100%} .first{border:1px solid #ddd;border-radius:6px;padding:.2em 1em;margin:.6em 0}
.first h3{margin:.6em 0 .2em} pre.rerun{margin:.25em 0;padding:.35em .6em} nav a{margin-right:.8em} .meta{color:#555}
"""


def e(value: object) -> str:
    """Text escaped for HTML."""
    return html.escape(str(value))


def verdict_class(verdict: str) -> str:
    return "UNDECIDED" if verdict == "COULD NOT DECIDE" else verdict


def cell_html(text: str) -> str:
    """A matrix cell of the Markdown report (`**FAIL** 1/3`, `PASS 3/3`, `NOT_SUPPORTED`), coloured."""
    plain = text.replace("**", "")
    first = plain.split(" ", 1)[0]
    css = {"FAIL": "fail", "PASS": "ok", "ok": "ok", "unknown": "unknown", "NOT_SUPPORTED": "ns"}.get(
        first, ""
    )
    return f'<td class="{css}">{e(plain)}</td>'


def table(header: list[str], rows: list[list[str]], numeric_from: int = 99) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = ""
    for row in rows:
        tds = "".join(
            c if c.startswith("<td") else f"<td{' class=num' if i >= numeric_from else ''}>{e(c)}</td>"
            for i, c in enumerate(row)
        )
        body += f"<tr>{tds}</tr>"
    return f'<div class="scroll"><table><tr>{head}</tr>{body}</table></div>'


def h2(key: str) -> str:
    """A section's heading, with the id its links point at (sections.SECTIONS)."""
    return f'<h2 id="{slug(SECTIONS[key])}">{e(SECTIONS[key])}</h2>'
