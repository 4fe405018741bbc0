"""The decode worker's dials of prefill workers' PD endpoints: one connection per pairing.

:class:`Dials` runs each pairing (a router's ``PairWith``): it closes this worker's previous
connection to that address before dialling it again, one dial per address at a time, and once
the handshake names the peer it closes the connections to any other address the same peer was
paired through (it moved: restarted elsewhere). Without it every re-pair left one more zmq
connection open, reconnecting for ever. It only sequences ``connect`` and ``close``; the PD
endpoint does the I/O. See docs/serving.md (Workers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvplane.ids import PeerId


class Dials:
    """Pairings of one decode worker (see the module docstring). Thread-safe: pairings with
    different addresses run at once, those with one address one after the other.

    ``connect(address, timeout_s)`` shakes hands and returns the peer's id (or raises);
    ``close(address)`` closes every connection this worker dialled to ``address`` (none: a
    no-op) and must not raise for that.
    """

    def __init__(
        self, connect: Callable[[str, float], PeerId], close: Callable[[str], None]
    ) -> None:
        self._connect = connect
        self._close = close
        self._lock = threading.Lock()
        self._turns: dict[str, tuple[threading.Lock, int]] = {}
        """address -> (its pairing lock, pairings holding or waiting for it)."""
        self._peers: dict[str, PeerId] = {}
        """address -> the peer the last pairing through it reached."""
        self.closed = 0
        """Connections closed for a pairing (a re-pair, or a peer that moved)."""

    def peers(self) -> dict[str, PeerId]:
        """A copy of the addresses paired through, with the peer each reached."""
        with self._lock:
            return dict(self._peers)

    def pair(self, address: str, timeout_s: float) -> PeerId:
        """Close this worker's connections to ``address``, dial it and shake hands; the peer's
        id. Then close the connections to every other address that reached that peer. A
        failed handshake raises what ``connect`` raised and leaves ``address`` unpaired."""
        turn = self._enter(address)
        try:
            with turn:
                with self._lock:
                    self.closed += self._peers.pop(address, None) is not None
                self._close(address)
                peer = self._connect(address, timeout_s)
                with self._lock:
                    moved = [a for a, p in self._peers.items() if p == peer and a != address]
                    for a in moved:
                        del self._peers[a]
                    self._peers[address] = peer
                    self.closed += len(moved)
        finally:
            self._leave(address)
        for a in moved:  # the peer answers at ``address`` now
            self._close(a)
        return peer

    def _enter(self, address: str) -> threading.Lock:
        with self._lock:
            lock, users = self._turns.get(address, (threading.Lock(), 0))
            self._turns[address] = (lock, users + 1)
        return lock

    def _leave(self, address: str) -> None:
        with self._lock:
            lock, users = self._turns[address]
            if users == 1:
                del self._turns[address]
            else:
                self._turns[address] = (lock, users - 1)
