"""The router's pairing table: each (decode, prefill) pair's latest pairing answer and backoff.

:class:`PairTable` records, per pair and for both workers' incarnations, how the decode worker
answered its last pairing (:class:`Pairing`), judges accepted pairs by the workers' info
answers (healing), and says when a lost or refused pair may be paired again (one
:class:`~kvplane.serving.router.healing.RepairBackoff` for both). Bookkeeping only, under its
own lock: it sends nothing and knows no client. See docs/serving.md (Membership, Healing).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from kvplane.serving.messages import WorkerInfo
from kvplane.serving.router.healing import RepairBackoff, lacks, says_paired

K = TypeVar("K", bound=Hashable)


class Pairing(enum.Enum):
    """How a decode worker answered a pairing."""

    ACCEPTED = "accepted"
    PENDING = "pending"  # no answer yet
    REFUSED = "refused"  # answered with anything but an Ack: paired again, with backoff
    LOST = "lost"  # accepted, then reported unpaired by either side: paired again, with backoff


RETRIED = (Pairing.LOST, Pairing.REFUSED)
"""The states a pair is paired again from only when its backoff allows it."""


@dataclass(frozen=True, slots=True)
class _Record:
    """A decode worker's latest answer to one pairing: for which incarnations (decode,
    prefill), what (``state``), and when it was recorded (``at``, monotonic)."""

    incarnations: tuple[int, int]
    state: Pairing
    at: float


@dataclass(frozen=True, slots=True)
class Report:
    """What one worker of a pair said about it: its ``address``, when the info query it
    answered was sent (``heard_at``, monotonic), its own info (``mine``) and the other
    worker's (``other``)."""

    address: str
    heard_at: float
    mine: WorkerInfo
    other: WorkerInfo


class PairTable(Generic[K]):
    """Pairing records and re-pair backoff per pair key (see the module docstring).
    Thread-safe. ``incs`` is always the pair's (decode, prefill) incarnations now: a record
    made for others is treated as absent."""

    def __init__(self, backoff: RepairBackoff[K] | None = None) -> None:
        self._lock = threading.Lock()
        self._records: dict[K, _Record] = {}
        self._backoff: RepairBackoff[K] = backoff if backoff is not None else RepairBackoff()

    def _current(self, key: K, incs: tuple[int, int]) -> _Record | None:
        """Under the lock: ``key``'s record if it is for ``incs``, else None."""
        rec = self._records.get(key)
        return rec if rec is not None and rec.incarnations == incs else None

    def state(self, key: K, incs: tuple[int, int]) -> Pairing | None:
        """The latest answer to pairing ``key`` for ``incs``; None: none for them."""
        with self._lock:
            rec = self._current(key, incs)
        return None if rec is None else rec.state

    def record(self, key: K, incs: tuple[int, int], state: Pairing, at: float) -> None:
        """Record an answer (``state``) to a pairing of ``key`` for ``incs``, made ``at``."""
        with self._lock:
            self._records[key] = _Record(incs, state, at)

    def forget(self, which: Callable[[K], bool]) -> None:
        """Forget the records and re-pair counts of every key for which ``which`` is True (a
        worker of it went down or restarted)."""
        with self._lock:
            for key in [k for k in self._records if which(k)]:
                del self._records[key]
            self._backoff.drop(which)

    def lose(self, key: K, incs: tuple[int, int], at: float) -> bool:
        """Mark accepted pair ``key`` LOST at ``at``; False, nothing changed, when its record
        for ``incs`` is not ACCEPTED."""
        with self._lock:
            rec = self._current(key, incs)
            if rec is None or rec.state is not Pairing.ACCEPTED:
                return False
            self._records[key] = replace(rec, state=Pairing.LOST, at=at)
        return True

    def judge(self, key: K, incs: tuple[int, int], reports: Sequence[Report], now: float) -> str:
        """Judge an accepted or LOST pair by ``reports`` sent after its record (an older one
        may predate it: not used). One reports it unpaired: an accepted pair becomes LOST at
        ``now``, and the reasons are returned (empty otherwise). None does and one reports it
        paired: a LOST pair is accepted again, and its re-pair count is reset."""
        with self._lock:
            rec = self._current(key, incs)
            if rec is None or rec.state not in (Pairing.ACCEPTED, Pairing.LOST):
                return ""
            fresh = [r for r in reports if r.heard_at >= rec.at]
            why = [
                f"{r.address} has no live PD connection to {r.other.peer_id!r}"
                for r in fresh
                if lacks(r.mine, r.other)
            ]
            if not why and any(says_paired(r.mine, r.other) for r in fresh):
                self._backoff.healed(key)
                self._records[key] = replace(rec, state=Pairing.ACCEPTED)
            if not why or rec.state is Pairing.LOST:
                return ""
            self._records[key] = replace(rec, state=Pairing.LOST, at=now)
        return "; ".join(why)

    def retry(self, key: K, incs: tuple[int, int], now: float) -> Pairing | None:
        """Whether LOST or REFUSED pair ``key`` is paired again at ``now``: its state (the
        cause) when its backoff allows it (the try is counted: the next one waits longer),
        else None (also for any other state)."""
        with self._lock:
            rec = self._current(key, incs)
            if rec is None or rec.state not in RETRIED or not self._backoff.due(key, now):
                return None
            self._backoff.tried(key, now)
            return rec.state

    def waiting(self, now: float) -> int:
        """Pairs LOST or REFUSED whose next pairing waits out its backoff at ``now``."""
        with self._lock:
            return sum(
                rec.state in RETRIED and not self._backoff.due(key, now)
                for key, rec in self._records.items()
            )

    def tries(self, key: K) -> int:
        """Pairings of ``key`` tried again since it was last seen paired."""
        with self._lock:
            return self._backoff.tries(key)
