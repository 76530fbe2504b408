"""The meta tier on xdist workers: the modules whose tests run whole suites in subprocesses go first.

xdist hands tests out in collection order, so a module of minute-long tests collected last leaves one
worker busy and the other idle at the end (on 2 cores: test_suite_catches_bugs.py's twenty-second tests
after the CLI's sub-second ones). Longest first keeps both busy to the end; each module stays whole, in
its own order."""

from __future__ import annotations

import pytest

#: modules of this folder by how long their tests take (measured on 2 cores, longest first)
LONG_FIRST = (
    "test_certify_quick.py",
    "test_reshard_backend_meta.py",
    "test_suite_catches_bugs.py",
    "test_fault_suite_catches_bugs.py",
    "test_reshard_meta.py",
    "test_memory_bound.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "numprocesses", None):
        return  # one process: the order makes no difference to the time
    rank = {name: k for k, name in enumerate(LONG_FIRST)}
    items.sort(
        key=lambda item: (
            rank.get(item.path.name, len(LONG_FIRST)) if "meta" in item.path.parts else len(LONG_FIRST)
        )
    )
