"""`nox -s weightsync`: certify this framework's weight-sync backend, as examples/ci/weightsync.yml does.

Copy beside your framework's pyproject.toml and set the three placeholders below. The report lands
under reports/ whatever the verdict; the session fails unless certify exits 0 (1 FAIL, 2 usage error,
3 could not decide).
"""

import nox

WEIGHTSYNC = "weightsync[oracle] @ git+https://github.com/OWNER/weightsync.git@v0.1.0"  # placeholder
BACKEND = "mypkg.sync:make_backend"  # placeholder: the factory returning your harness.api.Backend
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # without it pip picks a multi-GB CUDA build

nox.options.default_venv_backend = "venv"


@nox.session(python="3.11")
def weightsync(session: nox.Session) -> None:
    """Certify BACKEND against the reference engine; extra arguments go to certify (e.g. --no-faults)."""
    session.install("torch==2.13.0", "--index-url", TORCH_CPU_INDEX)
    session.install(WEIGHTSYNC)
    session.install("-e", ".")  # placeholder: how this framework installs
    session.run(
        "weightsync",
        "certify",
        "--backend",
        BACKEND,
        "--engine",
        "reference",
        "--out",
        "reports",
        *session.posargs,
    )
