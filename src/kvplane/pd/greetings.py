"""Handshakes in progress at one endpoint: answered ``Hello`` s and our own dials.

:class:`Greetings` holds the ``Hello`` s we accepted and answered until their ``HelloConfirm``
arrives: at most ``capacity``, each for ``timeout_s``, so that a flood of ``Hello`` s costs a
bounded amount of memory. :class:`Dial` is one handshake we started. No I/O; time is ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from kvplane.ids import PeerId
from kvplane.pd.association import Association
from kvplane.pd.events import Hello
from kvplane.validators import require_size

MAX_GREETINGS = 32
"""Answered ``Hello`` s awaiting their ``HelloConfirm``; the oldest is dropped beyond this."""
GREETING_S = 10.0
"""How long an answered ``Hello`` waits for its ``HelloConfirm``."""


@dataclass(slots=True)
class Greeting:
    """Responder side: the peer's ``Hello`` we accepted, our nonce, the association to be."""

    hello: Hello
    nonce: bytes
    assoc: Association
    expires: float


@dataclass(slots=True)
class Dial:
    """Initiator side: our ``Hello`` sent to ``address``; then the peer's (its reply), then its
    acknowledgement of our ``HelloConfirm`` completes ``future``."""

    address: str
    future: Future[PeerId]
    hello: Hello
    assoc: Association | None = None
    peer: Hello | None = None


class Greetings:
    """Answered ``Hello`` s by connection id, oldest first, bounded in number and age."""

    def __init__(self, capacity: int = MAX_GREETINGS, timeout_s: float = GREETING_S) -> None:
        require_size("Greetings.capacity", capacity, min=1)
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.expired = 0
        self.evicted = 0
        self._items: OrderedDict[bytes, Greeting] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, conn: bytes) -> bool:
        return conn in self._items

    def get(self, conn: bytes) -> Greeting | None:
        return self._items.get(conn)

    def pop(self, conn: bytes) -> Greeting | None:
        return self._items.pop(conn, None)

    def add(self, conn: bytes, hello: Hello, nonce: bytes, assoc: Association, now: float) -> None:
        """Hold ``conn``'s answered ``hello`` (replacing one it had), dropping expired ones
        and, beyond ``capacity``, the oldest."""
        self.expire(now)
        self._items.pop(conn, None)
        self._items[conn] = Greeting(hello, nonce, assoc, now + self.timeout_s)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
            self.evicted += 1

    def expire(self, now: float) -> None:
        while self._items and next(iter(self._items.values())).expires <= now:
            self._items.popitem(last=False)
            self.expired += 1
