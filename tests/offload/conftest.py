"""Shared fixtures for the offload tests: a Redis server and a namespace per test.

The Redis URL comes from ``KVPLANE_TEST_REDIS_URL`` (the test command starts a server and
exports it); without it a private ``redis-server`` is started on a free 127.0.0.1 port for the
session and stopped at its end; without a binary or client the remote tests skip, saying why.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplane.offload.tiers.redis_server import LocalRedisServer, redis_server_support
from kvplane.offload.tiers.remote import redis_support

# Test helpers live in offload_testlib.py beside this file (importlib mode puts no test
# directory on sys.path; this one is, for the offload tests only).
sys.path.insert(0, str(Path(__file__).resolve().parent))


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
