"""Progress of a long command (certify's suite parts and throughput rows, bench's rows), from its first second:
what runs now, how much is done of how much, and an estimate of what is left.

On a terminal it is a rich live display, one line per task; where the output is not a terminal, or CI=true,
it is plain lines (a line when a task starts, then one every `every_s`, or each time one more unit is
done where the task asks, and one when it ends), so a log keeps them without escape codes. Lines are printed whole (soft_wrap): a log path is never cut
across two lines."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Self

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


def plain_output(console: Console) -> bool:
    """Plain lines, not a live display: the console is not a terminal, or CI=true."""
    return not console.is_terminal or os.environ.get("CI", "").lower() == "true"


def left_estimate(done: float, total: float | None, elapsed_s: float) -> str:
    """'~2 min 10 s left' from the rate so far; 'estimate after the first' before anything is done."""
    if not total:
        return "total not known yet"
    if done <= 0:
        return "estimate after the first is done"
    left = elapsed_s / done * max(0.0, total - done)
    minutes, seconds = divmod(round(left), 60)
    return f"~{minutes} min {seconds} s left" if minutes else f"~{seconds} s left"


@dataclass
class _Task:
    total: float | None
    unit: str
    done: float = 0.0
    now: str = ""
    t0: float = field(default_factory=time.monotonic)
    printed_at: float = 0.0
    printed_done: float = 0.0
    each_unit: bool = False
    rich_id: int | None = None


class Progress:
    """Tasks by name: `start`, then `update` as often as wanted (plain lines are printed as the module says),
    then `finish` with a summary line printed in either mode."""

    def __init__(self, console: Console, every_s: float = 15.0, plain: bool | None = None):
        self.console, self.every_s = console, every_s
        self.plain = plain_output(console) if plain is None else plain
        self._tasks: dict[str, _Task] = {}
        self._live: RichProgress | None = None

    def __enter__(self) -> Self:
        if not self.plain:
            self._live = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[left]}  {task.fields[now]}"),
                console=self.console,
            )
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def start(
        self, name: str, total: float | None, unit: str, now: str = "", each_unit: bool = False
    ) -> None:
        """A task of `total` `unit`s (None: not known yet); `each_unit`: a plain line each time one more is
        done (throughput rows; not tests, which come by the hundred)."""
        task = self._tasks[name] = _Task(total, unit, now=now, each_unit=each_unit)
        if self._live is not None:
            task.rich_id = self._live.add_task(escape(name), total=total, left="", now=escape(now))
        self._line(name, task, "started")

    def update(self, name: str, done: float, total: float | None = None, now: str | None = None) -> None:
        task = self._tasks[name]
        task.done, task.total = done, total if total is not None else task.total
        task.now = task.now if now is None else now
        if self._live is not None:
            left = left_estimate(task.done, task.total, time.monotonic() - task.t0)
            self._live.update(task.rich_id, completed=done, total=task.total, left=left, now=escape(task.now))
        elif time.monotonic() - task.printed_at >= self.every_s or (
            task.each_unit and int(done) > int(task.printed_done)
        ):
            self._line(name, task, "")

    def finish(self, name: str, summary: str) -> None:
        """The task ends: its line leaves the live display and `summary` is printed (plain text)."""
        task = self._tasks.pop(name)
        if self._live is not None and task.rich_id is not None:
            self._live.remove_task(task.rich_id)
        self.console.print(summary, highlight=False, markup=False, soft_wrap=True)

    def _line(self, name: str, task: _Task, state: str) -> None:
        if self._live is not None:
            return
        task.printed_at, task.printed_done = time.monotonic(), task.done
        elapsed = task.printed_at - task.t0
        total = f"/{task.total:g}" if task.total else ""
        text = f"{name}: {state + ', ' if state else ''}{task.done:g}{total} {task.unit}, {elapsed:.0f} s"
        text += f", {left_estimate(task.done, task.total, elapsed)}"
        text += f"; now: {task.now}" if task.now else ""
        self.console.print(f"[progress] {text}", highlight=False, markup=False, soft_wrap=True)
