"""Progress from the first second (issue 40, item 4): bench and certify say what runs now, how much is done of
how much and what is left; plain lines where the output is no terminal (CI), a live display on one; a log
path is printed whole on one line however narrow the console."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from harness.progress import Progress, left_estimate
from harness.suite_runs import Part, SuiteArgs, run_parts

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]
#: the first line must come before torch is imported: seconds on a loaded 2-core host (interpreter included)
FIRST_LINE_BOUND_S = 5.0


def _long_dir(tmp_path: Path) -> Path:
    """A folder whose path is longer than any console line, so a wrapped path would show."""
    deep = tmp_path / ("a-folder-with-a-long-name-" * 3) / ("and-another-one-below-it-" * 3)
    deep.mkdir(parents=True)
    return deep


def test_bench_shows_progress_from_the_first_second_in_plain_lines(tmp_path):
    out = _long_dir(tmp_path)
    cmd = [sys.executable, "-m", "harness.cli", "bench", "--backend", "disk", "--sizes-mib", "1"]
    cmd += ["--receivers", "1", "--repeats", "1", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CI": "true", "COLUMNS": "80"}
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
        reader.join()
    text = "\n".join(line for _, line in lines)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text[-2000:]}"
    first = next(((at, line) for at, line in lines if line.startswith("[progress]")), None)
    assert first and first[0] < FIRST_LINE_BOUND_S, (
        f"first progress line {first} (bound {FIRST_LINE_BOUND_S} s):\n{text}"
    )
    assert "[progress] bench: started, 0/2 rows" in text, text  # the bare row and 1 MiB
    assert "[progress] bench: 1/2 rows" in text and "; now: " in text, text
    assert "\x1b[" not in text, "escape codes in a log"
    report = next(line for line in lines if line[1].startswith("PASS report: "))[1]
    assert Path(report.removeprefix("PASS report: ")).exists(), f"the report path was cut: {report!r}\n{text}"


TINY_SUITE = """
import time


def test_one():
    time.sleep(1.5)


def test_two():
    time.sleep(1.5)
"""


class TinyPart(Part):
    """A certify part that runs a two-test file under the weightsync plugin (its results file is kept up to
    date as the real suites' are)."""

    def command(self, run: SuiteArgs) -> list[str]:
        return [sys.executable, "-m", "pytest", str(run.out / "test_tiny.py"), "-q", "-p", "no:cacheprovider",
                "--weightsync-backend=disk", f"--weightsync-results={self.results(run.out)}"]  # fmt: skip


def test_certify_parts_show_tests_done_of_collected_and_print_the_log_path_whole(tmp_path, monkeypatch):
    out = _long_dir(tmp_path)
    (out / "test_tiny.py").write_text(TINY_SUITE)
    sink = io.StringIO()
    console = Console(file=sink, width=80, force_terminal=False)
    monkeypatch.setenv("CI", "true")
    part = TinyPart("conformance", ["disk"], "-tiny")
    done = run_parts([part], SuiteArgs("reference", out, "ci", "auto"), console)
    text = sink.getvalue()
    assert done["conformance-tiny"]["tests"], text
    lines = text.splitlines()
    assert lines[0].startswith("[progress] conformance-tiny disk: started, 0 tests"), text
    assert "conformance-tiny disk: 2 passed, 0 failed, 0 NOT_SUPPORTED in" in text, text
    log = str(out / "pytest-conformance-tiny.log")
    assert f"  log: {log}" in lines, f"the log path is not whole on one line:\n{text}"


def test_a_terminal_gets_a_live_display_and_a_log_gets_plain_lines(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    term = io.StringIO()
    with Progress(Console(file=term, force_terminal=True, width=100)) as progress:
        progress.start("bench", 4, "rows", each_unit=True)
        progress.update("bench", 1, now="disk: 1 receiver(s), 1 MiB, repeat 1/3")
        progress.finish("bench", "bench: 4 rows measured")
    assert "━" in term.getvalue() and "[progress]" not in term.getvalue(), repr(term.getvalue()[:400])
    plain = io.StringIO()
    with Progress(Console(file=plain, force_terminal=False), every_s=3600) as progress:
        progress.start("bench", 4, "rows", each_unit=True)
        progress.update("bench", 0.5, now="repeat 2/3")  # less than a row more, within every_s: no line
        progress.update("bench", 1, now="repeat 1/3")
        progress.finish("bench", "bench: 4 rows measured")
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("[progress] bench: started, 0/4 rows, 0 s, estimate after the first is done")
    assert lines[1].startswith("[progress] bench: 1/4 rows") and lines[1].endswith("left; now: repeat 1/3"), (
        lines
    )
    assert lines[2:] == ["bench: 4 rows measured"], lines


@pytest.mark.parametrize(
    ("done", "total", "elapsed", "says"),
    [(0, 10, 5.0, "estimate after the first is done"), (2, 10, 20.0, "~1 min 20 s left"), (5, None, 9.0, "total not known yet")],
)  # fmt: skip
def test_what_is_left_is_estimated_from_the_rate_so_far(done, total, elapsed, says):
    assert left_estimate(done, total, elapsed) == says
