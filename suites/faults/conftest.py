"""Fault suite: the `docker` marker (tests that run ranks as containers on a Docker bridge network)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "docker: needs a Docker engine (started by the test where dockerd exists and we are root); "
        "runs only with WEIGHTSYNC_DOCKER=1 (.ci/docker-tier.sh)",
    )
