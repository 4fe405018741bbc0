"""Suite-wide test policy.

- ``@pytest.mark.slow`` soak/fuzz runs only with ``KVPLANE_SLOW=1``.
- torch runs single-threaded: the tests use tiny tensors, where intra-op threads only add
  hand-off cost, and CI machines have two shared cores.
- ``redis_url``: the server of ``KVPLANE_TEST_REDIS_URL`` (the test command starts one), else a
  private ``redis-server`` for the session; without a binary or client the remote tests skip,
  saying why. ``redis_namespace``: a namespace unique to the test, emptied before and after.
- Native kernels (``cpu_fused``) are built into a private cache directory for the session
  (unless ``KVPLANE_CACHE_DIR`` is set), so the suite never writes into the user's home and
  always exercises the build once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from kvplane.native import CACHE_ENV as _CACHE_ENV
from kvplane.offload.tiers.remote import redis_support
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support

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


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("KVPLANE_TEST_REDIS_URL")
    reason = redis_support()
    if reason is not None:
        pytest.skip(reason)
    if url:
        yield url
        return
    reason = redis_server_support()
    if reason is not None:
        pytest.skip(f"KVPLANE_TEST_REDIS_URL is not set and {reason}")
    with LocalRedisServer() as server:
        yield server.url


@pytest.fixture
def redis_namespace(request: pytest.FixtureRequest, redis_url: str) -> Iterator[str]:
    """A namespace unique to the test, emptied before and after it."""
    import redis

    ns = "kvtest-" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()
    client = redis.Redis.from_url(redis_url)
    names = list(client.scan_iter(match=f"{ns}:*"))
    if names:
        client.delete(*names)
    yield ns
    names = list(client.scan_iter(match=f"{ns}:*"))
    if names:
        client.delete(*names)
    client.close()
