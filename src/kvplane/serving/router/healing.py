"""Healing of PD pairs: whether a worker reports a pair unpaired, and when to re-pair it.

Pure bookkeeping with ``now`` as an argument (no I/O, no locks, no clients): the router's
membership decides with it which vetted pairs a refresh re-pairs; it sends nothing itself.
See docs/serving.md (Membership).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvplane.errors import InvalidArgumentError
from kvplane.serving.messages import WorkerInfo
from kvplane.validators import require_finite_positive

K = TypeVar("K", bound=Hashable)

BACKOFF_FIRST_S = 1.0
"""Wait before a pair's second re-pair when it is still reported unpaired after the first
(the first goes at once); doubled at each further one, up to :data:`BACKOFF_MAX_S`."""
BACKOFF_MAX_S = 30.0
"""Longest wait between two re-pairs of one pair."""


def lacks(report: WorkerInfo, other: WorkerInfo) -> bool:
    """True when ``report`` lists its live PD peers (``WorkerInfo.peers``) and ``other``'s
    peer id is not among them; False when it is, or when ``report`` does not say."""
    return report.peers is not None and other.peer_id not in report.peers


def says_paired(report: WorkerInfo, other: WorkerInfo) -> bool:
    """True when ``report`` lists its live PD peers and ``other``'s peer id is among them."""
    return report.peers is not None and other.peer_id in report.peers


@dataclass(slots=True)
class _Tries:
    count: int
    next_at: float


class RepairBackoff(Generic[K]):
    """Per pair (any hashable key): the re-pairs tried since it was last seen paired, and the
    earliest time the next may go. The first goes at once; after the ``n``-th the next waits
    ``first_s * 2 ** (n - 1)``, at most ``max_s``. ``InvalidArgumentError`` for a wait that is
    not finite and positive, or ``max_s < first_s``."""

    def __init__(self, first_s: float = BACKOFF_FIRST_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.first_s = require_finite_positive("first_s", first_s, InvalidArgumentError)
        self.max_s = require_finite_positive("max_s", max_s, InvalidArgumentError)
        if max_s < first_s:
            raise InvalidArgumentError(f"max_s ({max_s}) must be at least first_s ({first_s})")
        self._tries: dict[K, _Tries] = {}

    def __len__(self) -> int:
        return len(self._tries)

    def tries(self, key: K) -> int:
        """Re-pairs of ``key`` tried since it was last seen paired."""
        rec = self._tries.get(key)
        return 0 if rec is None else rec.count

    def due(self, key: K, now: float) -> bool:
        """Whether a re-pair of ``key`` may go at ``now``."""
        rec = self._tries.get(key)
        return rec is None or now >= rec.next_at

    def tried(self, key: K, now: float) -> None:
        """Record a re-pair of ``key`` sent at ``now`` (the next waits longer)."""
        rec = self._tries.setdefault(key, _Tries(0, now))
        rec.count += 1
        rec.next_at = now + min(self.max_s, self.first_s * 2.0 ** min(rec.count - 1, 64))

    def healed(self, key: K) -> None:
        """``key`` was seen paired: its next break is re-paired at once."""
        self._tries.pop(key, None)

    def drop(self, which: Callable[[K], bool]) -> None:
        """Forget every key for which ``which`` is True (its worker went down or restarted)."""
        for key in [k for k in self._tries if which(k)]:
            del self._tries[key]
