"""A worker's live PD peers for info answers, read off the order thread.

:class:`LivePeers` keeps the answers that need the list waiting (never their caller's thread)
and reads the PD loop's live peers on its own thread, once for every answer waiting, each read
begun after all the answers it serves were queued: an answer never predates its query, and a
slow or stalled PD loop delays only these answers, each by at most ``wait_s`` from when it was
queued (then: None, does not say). It only reads; the order server's bounds on unanswered calls
bound what waits here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvplane.errors import InvalidArgumentError
from kvplane.validators import require_finite_positive

log = logging.getLogger(__name__)

Answer = Callable[[tuple[str, ...] | None], None]
"""Called once with the live peers (sorted), or None when they are not known."""


class LivePeers:
    """See the module docstring. ``read(timeout_s)`` returns the live peer ids (run on the PD
    loop by the caller's means) or raises ``TimeoutError`` after ``timeout_s``; a list longer
    than ``max_peers`` is answered as None. Thread-safe."""

    def __init__(
        self,
        read: Callable[[float], Sequence[str]],
        *,
        wait_s: float,
        max_peers: int,
        name: str = "kvplane-peers",
    ) -> None:
        self.wait_s = require_finite_positive("wait_s", wait_s, InvalidArgumentError)
        self.max_peers = max_peers
        self._read = read
        self._cond = threading.Condition()
        self._waiting: list[tuple[Answer, float]] = []  # with when its wait ends
        self._closed = False
        self.reads = 0
        """Batches of answers so far (one read of the PD loop each, unless out of time)."""
        self.unknown = 0
        """Batches answered None: the PD loop did not answer in their time."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def ask(self, answer: Answer) -> None:
        """Queue ``answer``: called on this object's thread with a list read after this call
        (None when the PD loop does not answer within ``wait_s`` of it, or once closed).
        Returns at once."""
        with self._cond:
            if not self._closed:
                self._waiting.append((answer, time.monotonic() + self.wait_s))
                self._cond.notify()
                return
        answer(None)

    def close(self) -> None:
        """Answer what waits with None and stop the thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.wait_s + 5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                batch, self._waiting = self._waiting, []
                closed = self._closed
            left = min(end for _, end in batch) - time.monotonic() if batch else 0.0
            peers = None if closed else self._read_once(left)
            for answer, _ in batch:
                try:
                    answer(peers)
                except Exception:  # a bug must not stop the answers
                    log.exception("an info answer failed")
            if closed:
                return

    def _read_once(self, timeout_s: float) -> tuple[str, ...] | None:
        """One read within ``timeout_s`` (none when it is not positive: None)."""
        self.reads += 1
        try:
            if timeout_s <= 0:
                raise TimeoutError
            live = self._read(timeout_s)
        except TimeoutError:
            self.unknown += 1
            return None
        return tuple(live) if len(live) <= self.max_peers else None
