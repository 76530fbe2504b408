"""The command line's values, checked as argparse reads them: each type below refuses a value before anything
runs (no torch import, no folder, no process), and argparse turns the refusal into a usage error, exit 2, that
names the option, the value and what is allowed: `argument --sizes-mib: '-5': a whole number of MiB, 1 or more`.
Also the help formatter every command shares: each option's sentence, then its default."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from importlib import metadata
from pathlib import Path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its examples keep their lines); each option's help followed by its default
    where the sentence does not name one already ("default: off" for a flag, "none" for an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        default = action.default
        if default is None:
            return text
        if default is False:
            shown = "off"
        elif isinstance(default, list | tuple):
            shown = " ".join(map(str, default)) or "none"
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"  # argparse %-formats help strings


def _refuse(text: str, allowed: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{text!r}: {allowed}")


def whole(least: int, what: str) -> Callable[[str], int]:
    """A type: a whole number `least` or more; `what` names the unit in the refusal ('MiB', 'receivers')."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise _refuse(text, f"a whole number of {what}, {least} or more")
        return value

    parse.__name__ = f"whole number of {what}"
    return parse


def number(
    what: str, low: float = 0.0, high: float = math.inf, low_ok: bool = False
) -> Callable[[str], float]:
    """A type: a finite number above `low` (or at it, `low_ok`) and at most `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value >= low if low_ok else value > low
        if not (math.isfinite(value) and above and value <= high):
            bounds = f"{'at least' if low_ok else 'greater than'} {low:g}"
            bounds += f" and at most {high:g}" if math.isfinite(high) else ""
            raise _refuse(text, f"{what}, {bounds}")
        return value

    parse.__name__ = what
    return parse


def jobs(text: str) -> str | int:
    """certify's --jobs: auto, or a whole number of workers, 1 or more."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise _refuse(text, "'auto' or a whole number of workers, 1 or more")
    return value


def receiver_counts(text: str) -> str:
    """certify's --receivers: auto, or comma-separated receiver counts, each 1 or more (kept as text: the
    suites take it as it is)."""
    if text == "auto":
        return text
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise _refuse(
            text, "'auto' or comma-separated receiver counts, each a whole number 1 or more (e.g. 1,2)"
        )
    return text


def parse_floor(spec: str) -> tuple[str, float]:
    """'ipc=0.7' -> ('ipc', 0.7); a ValueError naming the spec and what is allowed otherwise."""
    path, sep, value = spec.partition("=")
    try:
        ratio = float(value)
    except ValueError:
        ratio = -1.0
    if not sep or not path.strip() or not 0.0 < ratio <= 1.0:
        raise ValueError(
            f"floor {spec!r}: expected PATH=RATIO with RATIO in (0, 1] (a fraction of the verified "
            "ceiling's bandwidth), e.g. ipc=0.7"
        )
    return path.strip(), ratio


def floor(spec: str) -> str:
    """A type: --floor PATH=RATIO, 0 < RATIO <= 1; kept as written (a resumed certify compares them)."""
    try:
        parse_floor(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device(text: str) -> str:
    """A type: cpu, cuda or cuda:N, refused where this host plainly has no such device: torch is a CPU build,
    or the NVIDIA driver lists fewer GPUs (read from /proc, without importing torch). A device this cannot
    rule out is checked again once torch is loaded (harness.devices.check_available)."""
    if not _DEVICE.fullmatch(text):
        raise _refuse(text, "cpu, cuda or cuda:N (N a GPU index)")
    if text == "cpu":
        return text
    index = int(text.partition(":")[2] or 0)
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    if torch_version.endswith("+cpu"):
        raise _refuse(text, f"CUDA is not available here (torch {torch_version} is a CPU build): use cpu")
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        count = len(list(gpus.iterdir()))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            count = min(count, len([v for v in visible.split(",") if v.strip()]))
        if index >= count:
            raise _refuse(text, f"this host has {count} CUDA device(s): cpu or cuda:0..cuda:{count - 1}")
    return text


def ranks(text: str) -> list[int]:
    """A type: 'N', 'N-M' (N <= M) or a comma-separated list of them -> rank numbers, each listed once."""
    allowed = "ranks as N, N-M (N <= M) or a comma-separated list of them, each rank once, e.g. 0,2-3"
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and (not hi.isdigit() or int(hi) < int(lo))):
            raise _refuse(text, allowed)
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    if len(set(out)) != len(out):
        raise _refuse(text, allowed)
    return out
