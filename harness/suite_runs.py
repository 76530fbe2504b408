"""certify's suite runs: every selected backend's conformance suite in one pytest interpreter and its fault
matrix in another, side by side (the tests that time nothing; the conformance tests marked `serial` run
after them, alone), then split into one results file per backend and suite, as the report reads them.

One interpreter per suite, not per backend and suite: each costs seconds of imports and a warm fork
server of its own, and a suite's xdist workers fill the tail of one backend's slowest tests with
another's. Results are split by the backend each test records (harness.pytest_plugin.backend_of_item)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

#: The torchrun launch: it tests the launcher with BroadcastBackend, whatever is selected.
BROADCAST_LAUNCHER_TESTS = ("test_torchrun.py",)
#: Tests that bring their own ranks over gloo and use no selected backend (the resharded sync, the TP
#: engine): run once, in the broadcast column, like the launcher tests.
SELF_CONTAINED_TESTS = ("test_reshard.py", "test_tp_engine.py")
#: The column of the tests that exercise no selected backend (the two kinds above).
HOME_COLUMN = "broadcast"


def suite_dir(name: str) -> Path:
    import suites

    return Path(suites.__file__).parent / name


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


@dataclass
class SuiteArgs:
    """What every suite run of one certify shares."""

    engine: str
    out: Path
    profile: str
    receivers: str
    xfails_file: str | None = None
    quick: bool = False


@dataclass
class Part:
    """One pytest interpreter: a suite, the backends it takes, a marker selection, xdist workers (0: none)."""

    suite: str
    backends: list[str]
    tag: str
    marks: list[str] = field(default_factory=list)
    workers: int = 0

    @property
    def name(self) -> str:
        return f"{self.suite}{self.tag}"

    def results(self, out: Path) -> Path:
        return out / f"{self.suite}-run{self.tag}.json"

    def log(self, out: Path) -> Path:
        return out / f"pytest-{self.suite}{self.tag}.log"

    def command(self, run: SuiteArgs) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(suite_dir(self.suite)),
            "-q",
            "-p",
            "no:cacheprovider",
            f"--weightsync-backend={','.join(self.backends)}",
            f"--weightsync-engine={run.engine}",
            f"--weightsync-receivers={run.receivers}",
            f"--weightsync-results={self.results(run.out)}",
            f"--weightsync-hypothesis-profile={run.profile}",
            f"--junitxml={run.out / f'junit-{self.suite}{self.tag}.xml'}",
        ]
        if self.workers:
            cmd += ["-n", str(self.workers), "--dist", "worksteal"]
        if run.quick:
            cmd.append("--weightsync-quick")
        if run.xfails_file:
            cmd.append(f"--weightsync-xfails-file={Path(run.xfails_file).resolve()}")
        from harness.devices import run_device  # torch: imported once a run goes ahead

        if run_device() != "cpu":  # the rerun commands name it too
            cmd.append(f"--weightsync-device={run_device()}")
        if self.marks:
            cmd += ["-m", " and ".join(f"({m})" for m in self.marks)]
        if self.suite == "conformance" and HOME_COLUMN not in self.backends:
            # these drive BroadcastBackend itself, whatever is selected: they run in its column only
            for test in BROADCAST_LAUNCHER_TESTS + SELF_CONTAINED_TESTS:
                cmd += ["--deselect", f"suites/conformance/{test}"]  # node ids are relative to the rootdir
        return cmd


def plan_parts(conformance: list[str], faults: list[str], jobs: int) -> tuple[list[Part], list[Part]]:
    """The interpreters of a certify: those that run side by side (the conformance tests that time nothing,
    the fault matrix), then those that run alone afterwards (the conformance tests marked `serial`: a
    deadline or a throughput against a bound). `jobs` > 1: xdist workers for each of the first."""
    workers = jobs if jobs > 1 else 0
    together, alone = [], []
    if conformance:
        together.append(Part("conformance", conformance, "-parallel", ["not serial"], workers))
        alone.append(Part("conformance", conformance, "-serial", ["serial"], 0))
    if faults:  # the Docker tier and the soak run on their own; no fault cell is marked serial (a meta test)
        together.append(Part("faults", faults, "", ["not docker and not slow"], workers))
    return together, alone


def run_parts(parts: list[Part], run: SuiteArgs, console: Console) -> dict[str, dict]:
    """Start every part at once and wait for all of them, showing what each runs now, its tests done of
    those collected and an estimate of what is left (harness.progress); their results by name. Each part is
    a process group of its own (pytest and the ranks its tests start). certify stopped (SIGTERM, Ctrl-C):
    every part is stopped at once, its group killed after STOP_GRACE_S, then the stop goes on."""
    from harness.progress import Progress

    started = []
    with Progress(console) as progress:
        try:
            for part in parts:
                log = open(part.log(run.out), "w")  # noqa: SIM115 - closed below, after the part ends
                proc = subprocess.Popen(
                    part.command(run),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=suite_dir("..").resolve(),
                    start_new_session=True,  # its group: the ranks of a test it is stopped in go with it
                )
                started.append((part, proc, log, time.monotonic()))
                progress.start(_label(part, workers=True), None, "tests", now="collecting")
            done: dict[str, dict] = {}
            while len(done) < len(parts):
                for part, proc, log, t0 in started:
                    label = _label(part, workers=True)
                    if part.name in done:
                        continue
                    if proc.poll() is not None:
                        log.close()
                        data, summary = _finished_part(part, proc.returncode, run, t0)
                        done[part.name] = data
                        progress.finish(label, summary)
                        console.print(f"  log: {part.log(run.out)}", highlight=False, soft_wrap=True)
                    else:
                        progress.update(label, *_progress(part, run.out))
                time.sleep(0.5)
        except BaseException:
            stop_all([proc for _, proc, _, _ in started])
            for _, _, log, _ in started:
                log.close()
            raise
    return done


def _label(part: Part, workers: bool = False) -> str:
    """'conformance-parallel disk,ipc', with its xdist workers where asked."""
    label = f"{part.name} {','.join(part.backends)}"
    return label + (f" ({part.workers} xdist workers)" if workers and part.workers else "")


def _progress(part: Part, out: Path) -> tuple[int, int | None, str]:
    """(tests done, tests collected, the test running now) from the results file the part keeps up to date."""
    try:
        data = json.loads(part.results(out).read_text())
    except (OSError, ValueError):
        return 0, None, "collecting"
    running = data.get("running") or ""
    return len(data.get("tests", {})), data.get("collected"), running.rsplit("/", 1)[-1]


def _finished_part(part: Part, returncode: int, run: SuiteArgs, t0: float) -> tuple[dict, str]:
    """The part's results (its failure recorded where it was stopped) and the line that sums it up."""
    results, log = part.results(run.out), part.log(run.out)
    if not results.exists():
        data = {
            "exitstatus": returncode,
            "tests": {},
            "error": f"pytest produced no results (exit {returncode}); see {log}",
        }
    else:
        data = json.loads(results.read_text())
        if not data.get("complete", True):  # killed mid-run: the file holds what finished before
            data["exitstatus"] = returncode if returncode not in (0, 5) else 3
            data["error"] = (
                f"pytest stopped (exit {returncode}) during {data.get('running') or 'teardown'}; see {log}"
            )
            fail_the_stopped_test(data, returncode, log)
    statuses = [r.get("status") for r in data["tests"].values()]
    summary = (
        f"{_label(part)}: {statuses.count('passed')} passed, {statuses.count('failed')} failed, "
        f"{statuses.count('not_supported')} NOT_SUPPORTED in {time.monotonic() - t0:.0f}s"
        f"{f' ({part.workers} xdist workers)' if part.workers else ''}"
    )
    return data, summary


def run_suites(
    conformance: list[str], faults: list[str], run: SuiteArgs, jobs: int, console: Console
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Run what is left of a certify's suites (`conformance`, `faults`: the backends whose suite this bundle
    has not finished) and return each suite's results by backend; each backend's finished results are
    written as <suite>-<backend>.json, what `--resume` reuses."""
    together, alone = plan_parts(conformance, faults, jobs)
    done = run_parts(together, run, console) if together else {}
    first = done.get("conformance-parallel", {})
    if first.get("serial_tests", 1) and not first.get("error"):  # none to run; or stopped: the rest did not
        done |= run_parts(alone, run, console)
    split = {}
    for suite, names in (("conformance", conformance), ("faults", faults)):
        parts = [done[p.name] for p in together + alone if p.suite == suite and p.name in done]
        if not parts:
            split[suite] = {}
            continue
        split[suite] = split_by_backend(merged_parts(parts), names)
        for name, data in split[suite].items():
            data["jobs"] = jobs
            if data.get("complete") and not data.get("error"):
                (run.out / f"{suite}-{slug(name)}.json").write_text(
                    json.dumps(data, indent=2, sort_keys=True)
                )
    return split["conformance"], split["faults"]


def split_by_backend(data: dict, names: list[str]) -> dict[str, dict]:
    """One run of several backends as one results dict per backend, as a run of that backend alone writes
    it: its tests (those of no backend go to HOME_COLUMN where it ran, else to the first backend), its
    receivers and capabilities, its quick_skipped; each is complete and in error as the run was; its exit
    status is 1 where one of its own tests failed (or where the run failed with no test failed: a teardown)."""
    home = HOME_COLUMN if HOME_COLUMN in names else names[0]
    of = {**data.get("quick_skipped_backends", {})}
    for nodeid, rec in data.get("tests", {}).items():
        of[nodeid] = rec.get("backend") or of.get(nodeid)
    failed = {of.get(n) or home for n, r in data.get("tests", {}).items() if r.get("status") in BAD}
    status = data.get("exitstatus", 0)
    split = {}
    for name in names:
        mine = dict(data)
        mine.pop("quick_skipped_backends", None)
        mine.pop("collected", None)
        mine.pop("serial_tests", None)
        mine["backend"] = name
        mine["tests"] = {n: r for n, r in data.get("tests", {}).items() if (of.get(n) or home) == name}
        for key in ("receivers", "capabilities"):
            if key in data:
                mine[key] = {k: v for k, v in data[key].items() if k == name}
        if "quick_skipped" in data:
            mine["quick_skipped"] = [n for n in data["quick_skipped"] if (of.get(n) or home) == name]
        if status == 1 and failed:
            mine["exitstatus"] = 1 if name in failed else 0
        for key in ("running", "in_flight"):
            mine.pop(key, None)
        flight = [n for n in data.get("in_flight", []) if (of.get(n) or home) == name]
        if flight:
            mine["in_flight"], mine["running"] = flight, flight[-1]
        split[name] = mine
    return split


#: The statuses that fail a run (pytest exits 1).
BAD = ("failed", "error", "xpassed")


def merged_parts(parts: list[dict]) -> dict:
    """The results of a suite run in parts (parallel, then serial) as one: every test, complete only if
    every part was, the worst exit status (5, no tests, only where no part ran any), the first error."""
    data = dict(parts[0])
    data["tests"] = {k: v for part in parts for k, v in part.get("tests", {}).items()}
    data["complete"] = all(part.get("complete", True) for part in parts)
    statuses = [part.get("exitstatus", 0) for part in parts]
    worst = [s for s in statuses if s not in (0, 1, 5)]
    data["exitstatus"] = worst[0] if worst else 1 if 1 in statuses else 5 if set(statuses) == {5} else 0
    for key in ("error", "running", "in_flight"):
        found = [part[key] for part in parts if part.get(key)]
        data.pop(key, None)
        if found:
            data[key] = found[0]
    if any("quick_skipped" in part for part in parts):
        data["quick_skipped"] = sorted({n for part in parts for n in part.get("quick_skipped", [])})
        data["quick_skipped_backends"] = {
            k: v for part in parts for k, v in part.get("quick_skipped_backends", {}).items()
        }
    return data


def fail_the_stopped_test(data: dict, returncode: int, log: Path) -> None:
    """A run stopped during a test (a hang its supervisor ended, a crash): that test failed. The plugin
    records a SIGTERM itself ('hung: stopped after N s in <test>; rank ...'); a run that could not (SIGKILL,
    a segfault) gets its record here. A run stopped outside any test names none: it stays undecided."""
    from harness.procs import describe_exit

    if not data.get("running"):
        return
    for nodeid in data.get("in_flight") or [data["running"]]:  # several under xdist (certify --jobs)
        rec = data.setdefault("tests", {}).setdefault(nodeid, {})
        if rec.get("status") != "failed":
            where = "in its teardown" if rec.get("status") else "during it, with no result of its own"
            rec["status"] = "failed"
            rec["message"] = f"pytest stopped ({describe_exit(returncode)}) {where}; see {log}"


#: How long a stopped part has to record the test it was stopped in before its group is killed: certify's
#: whole stop stays within harness.stopping.STOP_BOUND_S.
STOP_GRACE_S = 5.0


def stop_all(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every part at once, so each suite's plugin records the test it hung in (and the ranks' calls
    in flight) as failed; then SIGKILL each part's process group (pytest and every rank it started) once it
    has ended or `grace_s` has passed."""
    from harness.stopping import kill_group

    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    end = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_group(proc.pid)  # its group id is its pid (start_new_session)
        proc.wait()


def finished_suite(out: Path, suite: str, backend: str, console: Console | None = None) -> dict | None:
    """A suite's results that an earlier run in this bundle wrote to the end (pytest finished: `complete`),
    reused as they are; None where there are none or the run was stopped in it (that suite runs again)."""
    results = out / f"{suite}-{slug(backend)}.json"
    if not results.exists():
        return None
    data = json.loads(results.read_text())
    if not data.get("complete"):
        return None
    if console is not None:
        statuses = [r.get("status") for r in data["tests"].values()]
        console.print(
            f"{suite} {backend}: reused from this bundle's earlier run ({results.name}: "
            f"{statuses.count('passed')} passed, {statuses.count('failed')} failed)"
        )
    return data
