"""Suite-wide test policy.

- ``@pytest.mark.slow`` soak/fuzz runs only with ``KVPLANE_SLOW=1``.
- torch runs single-threaded: the tests use tiny tensors, where intra-op threads only add
  hand-off cost, and CI machines have two shared cores.
- Native kernels (``cpu_fused``) are built into a private cache directory for the session
  (unless ``KVPLANE_CACHE_DIR`` is set), so the suite never writes into the user's home and
  always exercises the build once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from kvplane.native import CACHE_ENV as _CACHE_ENV

_MADE_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(_CACHE_ENV):
        config.stash[_MADE_CACHE] = os.environ[_CACHE_ENV] = tempfile.mkdtemp(
            prefix="kvplane-kernels-"
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_MADE_CACHE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)


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
