"""Every test here times something against a bound (a throughput floor, a ceiling, a link's rating): each is
marked `serial`, so a parallel run (pytest -n N, certify --jobs) runs it after the rest, alone."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.serial)
