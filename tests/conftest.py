"""Suite-wide test policy.

- ``@pytest.mark.slow`` soak/fuzz runs only with ``KVPLANE_SLOW=1``.
- torch runs single-threaded: the tests use tiny tensors, where intra-op threads only add
  hand-off cost, and CI machines have two shared cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KVPLANE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="soak/fuzz run: set KVPLANE_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _single_thread_torch() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
