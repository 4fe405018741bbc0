"""Fixtures of the command tests: serve processes that are stopped whatever the test does."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from kvplane.testing.cluster import Proc


@pytest.fixture
def procs(stop_procs: Callable[[Sequence[Proc]], None]) -> Iterator[list[Proc]]:
    """A list the test appends its started ``kvplane serve`` processes to; every one still
    running at the end is stopped (SIGTERM to all at once, then SIGKILL after 15 s)."""
    started: list[Proc] = []
    yield started
    stop_procs(started)
