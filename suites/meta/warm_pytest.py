"""pytester's `runpytest_subprocess`, run in a child forked from a warm interpreter.

A meta test runs a whole suite in a pytest of its own, so that the suite's failures are its result and
not this run's. A fresh interpreter pays 2-3 CPU-seconds before its first test (torch, pytest, hypothesis
and the plugin's other imports, on 2 cores), and the meta tier starts about seventy of them. The child here
is a fork of harness.warm's server (those modules already imported, nothing run) that takes the test's
environment, working directory and import path, as `python -m pytest` in pytester's folder would, with
pytester's PYTHONPATH rule (its folder first). What a fresh interpreter tests about itself (which plugins
load, what is imported at startup: test_plugin_manners.py, test_missing_dependency.py) stays on
`runpytest_subprocess`.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from _pytest.pathlib import make_numbered_dir

from harness import warm

#: What a pytest run imports before its first test, beyond harness.warm's own PRELOAD.
PRELOAD = (
    "pytest",
    "_pytest.pytester",
    "hypothesis",
    "numpy",
    "rich.console",
    "httpx",
    "harness.pytest_plugin",
)
#: Seconds a child stopped with SIGTERM (its test interrupted) gets to stop its own ranks.
STOP_GRACE_S = 10.0


def runpytest_warm(pytester: pytest.Pytester, *args: str | os.PathLike[str], timeout: float | None = None):
    """What `pytester.runpytest_subprocess(*args, timeout=timeout)` does, from a warm fork: a RunResult
    with the run's exit code and its stdout and stderr lines."""
    __tracebackhide__ = True
    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    # The child imports harness, hypothesis and suites before pytest starts, so pytest cannot rewrite their
    # asserts and says so once per package; a fresh interpreter would not have imported them yet.
    cmd = [f"--basetemp={basetemp}", "-W", "ignore::pytest.PytestAssertRewriteWarning", *map(os.fspath, args)]
    for plugin in pytester.plugins:
        if not isinstance(plugin, str):
            raise ValueError(f"plugins are named for a subprocess run, not passed as objects: {plugin}")
        cmd = ["-p", plugin, *cmd]
    env, cwd, path = warm.here()
    # pytester.popen's rule: the folder the run starts in comes first on PYTHONPATH
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH", "")]))
    # a fresh interpreter puts PYTHONPATH's folders (cwd among them) first on its import path
    path = [*dict.fromkeys([*filter(None, env["PYTHONPATH"].split(os.pathsep)), *path])]
    out, err = pytester.path / "stdout", pytester.path / "stderr"
    print("running (warm fork): pytest", *cmd)
    print("     in:", cwd)
    ctx = warm.context(PRELOAD)
    proc = ctx.Process(target=warm.inherit, args=((env, cwd, path), _pytest_main, cmd, str(out), str(err)))
    t0 = time.monotonic()
    proc.start()
    try:
        proc.join(timeout)
        if proc.exitcode is None:
            raise pytester.TimeoutExpired(f"{timeout} second timeout expired running: pytest {cmd}")
    finally:
        if proc.exitcode is None:  # interrupted or timed out: the run stops its ranks on SIGTERM
            proc.terminate()
            proc.join(STOP_GRACE_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    outlines = out.read_text(encoding="utf8", errors="replace").splitlines()
    errlines = err.read_text(encoding="utf8", errors="replace").splitlines()
    for lines, stream in ((outlines, sys.stdout), (errlines, sys.stderr)):
        if lines:  # as pytester.run: shown with the test's own output when it fails
            print("\n".join(lines), file=stream)
    ret: int | pytest.ExitCode = proc.exitcode
    try:
        ret = pytest.ExitCode(ret)
    except ValueError:
        pass
    return pytest.RunResult(ret, outlines, errlines, time.monotonic() - t0)


def _pytest_main(args: list[str], stdout: str, stderr: str) -> None:
    """The child: pytest's main with its output in the two files, then out, with the run's exit code."""
    for fd, name in ((1, stdout), (2, stderr)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", encoding="utf8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter: the plugin sets its own
    sys.argv = [str(Path(pytest.__file__).with_name("__main__.py")), *args]
    code = 1
    try:
        code = int(pytest.main(args))
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter's exit would run; os._exit below does not
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
