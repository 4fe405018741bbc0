"""Suite-wide test policy: ``@pytest.mark.slow`` soak/fuzz runs only with ``KVPLANE_SLOW=1``."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KVPLANE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="soak/fuzz run: set KVPLANE_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
