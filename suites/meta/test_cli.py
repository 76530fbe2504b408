"""The command line: a name that cannot be resolved is a usage error before anything runs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "refrence"], "unknown engine 'refrence'"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--floor", "disk=fast"], "disk=fast"),
        (["--backend", "reshard", "--tp", "3"], "reshard --tp 3"),
        (["--backend", "reshard", "--trainer-ranks", "0"], "trainer ranks, 1 or more"),
        (["--backend", "ipc", "--tp", "2"], "--trainer-ranks and --tp shape the reshard backend"),
    ],
)
def test_certify_refuses_an_unknown_name_at_once_and_writes_nothing(tmp_path, args, message):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "certify", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 2, f"exit {proc.returncode}, expected 2 (usage):\n{proc.stderr[-1500:]}"
    assert message in proc.stderr, (
        f"the error does not name the bad input ({message!r}):\n{proc.stderr[-1500:]}"
    )
    assert not any(tmp_path.iterdir()), f"a usage error left {sorted(p.name for p in tmp_path.iterdir())}"
    assert took < 60, f"a usage error took {took:.0f} s (nothing should have run)"


def test_certify_help_epilog_names_exit_statuses_0_to_3(capsys):
    from harness.cli import main

    with pytest.raises(SystemExit):
        main(["certify", "--help"])
    out = capsys.readouterr().out
    for line in ("0  PASS", "1  FAIL", "2  usage error", "3  COULD NOT DECIDE"):
        assert line in out, f"{line!r} not in certify --help:\n{out[-1500:]}"


@pytest.mark.parametrize(
    ("engine", "measured", "says"),
    [
        ("reference", "reference", "measured with the engine under test, reference"),
        ("vllm", "reference", "--engine vllm was not measured because"),
    ],
)
def test_throughput_names_the_engine_it_measured(engine, measured, says):
    from harness.cli import throughput_engine
    from harness.registry import engine_path

    path, note = throughput_engine(engine)
    assert path == engine_path(measured), f"--engine {engine}: throughput measured with {path}"
    assert says in note, note
