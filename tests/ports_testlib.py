"""Free TCP ports on 127.0.0.1 for tests that start servers: one port, or a run of consecutive
ones (a KV-event publisher's PUB and replay ports, a TP engine's per-rank PD endpoints).

The one home of the tests' free-port helpers: ``free_port`` is :mod:`kvplane.testing.cluster`'s,
re-exported here. A port is free when asked, not reserved: the caller binds it soon after.
Imported as ``ports_testlib`` (``tests/conftest.py`` puts this directory on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import socket

from kvplane.errors import InvalidArgumentError
from kvplane.testing.cluster import free_port

__all__ = ["free_port", "free_ports"]

TRIES = 100
"""Candidate first ports tried before giving up."""


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports on 127.0.0.1 that were all free a moment ago
    (``n == 1``: one free port). Raises ``OSError`` when :data:`TRIES` candidates all fail."""
    if n < 1:
        raise InvalidArgumentError(f"free_ports needs n >= 1, got {n}")
    for _ in range(TRIES):
        first = free_port()
        if first + n > 65536:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise OSError(f"no {n} consecutive free ports on 127.0.0.1")
