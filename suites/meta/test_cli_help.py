"""Each command says how it is used and launched (issue 40, item 3): every option's --help has a sentence and
its default, developer notes stay out of user help, and validate-cluster outside torchrun says to launch it
under torchrun, printing the line to use."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main

pytestmark = pytest.mark.meta

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("certify", "bench", "cost", "validate-cluster")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from harness.cli import __doc__ as usage
    from harness.cli_parser import build_parser
    from harness.cluster_args import build_parser as cluster_parser

    root = build_parser(usage, "Exit status")
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return {
        **{n: p for n, p in sub.choices.items() if n != "validate-cluster"},
        "validate-cluster": cluster_parser(),
    }


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0, f"{command} --help exited {exited.value.code}"
    return out.getvalue()


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_option_has_a_sentence_of_help_and_its_default(command):
    parser = _parsers()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = "/".join(action.option_strings)
        text = action.help or ""
        assert len(text.split()) >= 3, (
            f"weightsync {command} --help: {flag} has no sentence of help: {text!r}"
        )
        shown = formatter._get_help_string(action)
        if action.default not in (None, argparse.SUPPRESS):
            assert "default" in shown.lower(), (
                f"weightsync {command} --help: {flag} does not show its default: {shown!r}"
            )
    assert parser.description and len(parser.description.split()) >= 10, f"{command} has no description"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_prints_and_keeps_developer_notes_out(command):
    text = _help(command)
    assert "Why one file" not in text, f"{command} --help prints a developer note:\n{text[:1500]}"
    assert "usage: weightsync" in text, text[:500]


def test_validate_cluster_help_says_to_launch_it_under_torchrun():
    assert "torchrun --standalone --nproc-per-node=4 -m harness.cli validate-cluster" in _help(
        "validate-cluster"
    )


def test_validate_cluster_outside_torchrun_prints_the_torchrun_line_and_exits_2(tmp_path):
    """The issue's second row: a raw torch traceback ending 'environment variable RANK expected'."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    args = ["validate-cluster", "--trainer-ranks", "0", "--rollout-ranks", "1-3", "--sizes-mib", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr[-1500:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "not launched by torchrun" in proc.stderr, proc.stderr[-1500:]
    line = f"torchrun --standalone --nproc-per-node=4 -m harness.cli {' '.join(args)} --out {tmp_path}"
    assert line in proc.stderr, f"the torchrun line to use ({line!r}) is not printed:\n{proc.stderr[-1500:]}"
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())
