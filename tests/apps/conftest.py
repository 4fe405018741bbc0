"""Fixtures of the command tests: serve processes that are stopped whatever the test does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.testing.cluster import Proc


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """A list the test appends its started ``kvplane serve`` processes to; every one still
    running at the end is stopped (SIGTERM, then SIGKILL)."""
    started: list[Proc] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.stop()
