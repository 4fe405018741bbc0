"""Admission of calls on an order server: bounded waiting calls, and shared answers.

:class:`Admission` owns how many calls wait for an answer, per connection and in all, and the
groups of identical queries that wait together for one answer. It never touches a socket and
never decodes a frame: ``rpc`` does, and calls it from any thread. See docs/serving.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from kvplane.errors import InvalidArgumentError
from kvplane.validators import require_int

R = TypeVar("R")

MAX_PENDING = 8192
"""Default: most calls an order server holds unanswered, over every connection."""
MAX_PENDING_PER_PEER = 2048
"""Default: most calls one connection may have unanswered (a router's decode orders included:
each waits until its request ends)."""


class Admission:
    """Bounds on unanswered calls and groups of shared answers (see the module docstring).
    Thread-safe. ``shared``: the message types whose identical instances, while one of them
    waits for its answer, share that answer (a query answered from the server's state alone).
    ``InvalidArgumentError`` for a bound < 1 or a per-connection bound over the total."""

    def __init__(
        self,
        *,
        max_pending: int = MAX_PENDING,
        max_pending_per_peer: int = MAX_PENDING_PER_PEER,
        shared: tuple[type, ...] = (),
    ) -> None:
        self.max_pending = require_int("max_pending", max_pending, min=1)
        self.max_per_peer = require_int("max_pending_per_peer", max_pending_per_peer, min=1)
        if self.max_per_peer > self.max_pending:
            raise InvalidArgumentError(
                f"max_pending_per_peer ({max_pending_per_peer}) exceeds max_pending ({max_pending})"
            )
        self.shared = shared
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}
        self._total = 0
        self._groups: dict[Hashable, list[Callable[[Any], None]]] = {}

    @property
    def pending(self) -> int:
        """Calls admitted and not answered yet."""
        return self._total

    def admit(self, peer: bytes) -> str | None:
        """Take a slot for one call from connection ``peer``; None when taken, else why not
        (nothing changed). Each slot taken is given back by exactly one :meth:`release`."""
        with self._lock:
            held = self._pending.get(peer, 0)
            if held >= self.max_per_peer:
                return f"busy: {held} calls of this connection wait for answers"
            if self._total >= self.max_pending:
                return f"busy: {self._total} calls wait for answers"
            self._pending[peer] = held + 1
            self._total += 1
            return None

    def release(self, peer: bytes) -> None:
        """Give back a slot of ``peer`` (its call was answered)."""
        with self._lock:
            held = self._pending.get(peer, 0)
            if held <= 0:
                return
            if held == 1:
                del self._pending[peer]
            else:
                self._pending[peer] = held - 1
            self._total -= 1

    def join(self, msg: Hashable, answer: Callable[[R], None]) -> Callable[[R], None] | None:
        """Where the handler's answer to ``msg`` goes: ``answer`` itself for a message that is
        not shared; for a shared one, None when an identical one already waits (``answer``
        joins its group and gets its answer), else a fan-out that answers the whole group
        (every member that joined before the answer)."""
        if not isinstance(msg, self.shared):
            return answer
        with self._lock:
            group = self._groups.get(msg)
            if group is not None:
                group.append(answer)
                return None
            self._groups[msg] = [answer]

        def fan_out(reply: R) -> None:
            with self._lock:
                members = self._groups.pop(msg, [])
            for member in members:
                member(reply)

        return fan_out
