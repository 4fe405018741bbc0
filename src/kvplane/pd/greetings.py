"""Handshakes in progress at one endpoint: answered ``Hello`` s and our own dials.

:class:`Greetings` holds the ``Hello`` s we accepted and answered until their ``HelloConfirm``
arrives: one slot per peer id (a new ``Hello`` of that peer id replaces its own, never anyone
else's), at most ``capacity`` slots, each for ``timeout_s``; when all are taken a newcomer is
turned away. It also remembers the nonces of recent ``Hello`` s, so that a replayed copy is
dropped unanswered. :class:`Dial` is one handshake we started. No I/O; time is ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from kvplane.ids import PeerId
from kvplane.pd.association import Association
from kvplane.pd.events import Hello
from kvplane.validators import require_size

__all__ = ["GREETING_S", "MAX_GREETINGS", "SEEN_NONCES", "Dial", "Greeting", "Greetings"]

MAX_GREETINGS = 32
"""Answered ``Hello`` s (distinct peer ids) awaiting their ``HelloConfirm``."""
GREETING_S = 10.0
"""How long an answered ``Hello`` waits for its ``HelloConfirm``."""
SEEN_NONCES = 4096
"""How many recent ``Hello`` nonces are remembered to drop replayed copies (64 KiB of nonces)."""


@dataclass(slots=True)
class Greeting:
    """Responder side: the peer's ``Hello`` we accepted on connection ``conn``, our nonce, the
    association to be."""

    conn: bytes
    hello: Hello
    nonce: bytes
    assoc: Association
    expires: float


@dataclass(slots=True)
class Dial:
    """Initiator side: our ``Hello`` sent to ``address``; then the peer's nonce (its reply),
    then its acknowledgement, carrying its ``Hello`` (``peer``), completes ``future``."""

    address: str
    future: Future[PeerId]
    hello: Hello
    assoc: Association | None = None
    peer_nonce: bytes = b""
    peer: Hello | None = None


class Greetings:
    """Answered ``Hello`` s by peer id (and by connection), oldest first, bounded in number
    and age; plus the bounded memory of recent ``Hello`` nonces."""

    def __init__(
        self,
        capacity: int = MAX_GREETINGS,
        timeout_s: float = GREETING_S,
        seen_nonces: int = SEEN_NONCES,
    ) -> None:
        require_size("Greetings.capacity", capacity, min=1)
        require_size("Greetings.seen_nonces", seen_nonces, min=1)
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.expired = 0
        self.turned_away = 0
        self.replaced = 0
        self._items: OrderedDict[str, Greeting] = OrderedDict()
        self._by_conn: dict[bytes, str] = {}
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._seen_cap = seen_nonces

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, conn: bytes) -> bool:
        return conn in self._by_conn

    def get(self, conn: bytes) -> Greeting | None:
        peer = self._by_conn.get(conn)
        return None if peer is None else self._items[peer]

    def pop(self, conn: bytes) -> Greeting | None:
        """Remove and return connection ``conn``'s greeting, if any."""
        peer = self._by_conn.pop(conn, None)
        return None if peer is None else self._items.pop(peer)

    def replayed(self, nonce: bytes) -> bool:
        """True if a ``Hello`` with ``nonce`` was seen among the last ``seen_nonces``;
        otherwise remember it (the oldest is forgotten beyond the bound). An empty nonce
        (refused anyway) is never remembered."""
        if not nonce:
            return False
        if nonce in self._seen:
            return True
        self._seen[nonce] = None
        if len(self._seen) > self._seen_cap:
            self._seen.popitem(last=False)
        return False

    def has_room(self, conn: bytes, peer_id: str, now: float) -> bool:
        """Whether :meth:`add` of ``peer_id`` on ``conn`` would find a slot: the peer id's own
        or the connection's (both replaced), or a free one after expiring old greetings."""
        self.expire(now)
        return peer_id in self._items or conn in self._by_conn or len(self) < self.capacity

    def add(self, conn: bytes, hello: Hello, nonce: bytes, assoc: Association, now: float) -> bool:
        """Hold ``conn``'s answered ``hello``, replacing the greeting of the same peer id and
        the one ``conn`` had; False (nothing held, counted ``turned_away``) when every slot
        is taken by other peer ids. Never evicts another peer id's greeting."""
        peer_id = hello.peer_id
        if not self.has_room(conn, peer_id, now):
            self.turned_away += 1
            return False
        old = self._items.pop(peer_id, None)
        if old is not None:
            self._by_conn.pop(old.conn, None)
            self.replaced += 1
        self.pop(conn)
        self._items[peer_id] = Greeting(conn, hello, nonce, assoc, now + self.timeout_s)
        self._by_conn[conn] = peer_id
        return True

    def expire(self, now: float) -> None:
        """Drop the greetings whose confirm did not come within ``timeout_s``."""
        while self._items:
            first = next(iter(self._items.values()))
            if first.expires > now:
                return
            self.pop(first.conn)
            self.expired += 1
