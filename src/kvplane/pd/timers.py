"""Protocol timings and the timer queue that turns ``ArmTimer`` actions into ``Timeout`` events.

Sessions never read a clock: they emit ``ArmTimer(timer, unit, delay_s)`` and later receive a
``Timeout``. Whoever owns the clock (a ``Participant`` given ``now`` by its endpoint or by a
simulation) keeps a :class:`TimerQueue`. Arming never *extends* a deadline: arming a key that is
already armed keeps the earlier of the two deadlines, which is what makes the IN_DOUBT release
deadline fail-closed even if a caller re-arms by mistake.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.validators import require_finite_positive

KeyT = TypeVar("KeyT", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Timings:
    """Every delay of the protocol, in seconds.

    ``deadline_s`` bounds a receiver session; a sender waits ``verdict_grace_s`` longer for the
    receiver's verdict before failing on its own, counted from its open until the receiver's
    request arrives and from that arrival afterwards (so it holds its KV for at most twice
    ``sender_deadline_s``). ``retransmit_s`` paces resends of what the peer
    has not acknowledged. ``drain_s`` bounds how long an abort waits for in-flight work (sender)
    or for the abort ack (receiver) before declaring it IN_DOUBT; ``in_doubt_s`` is the
    fail-closed release deadline of an IN_DOUBT unit. A peer whose lease (``lease_s``) is not
    renewed by a heartbeat (every ``heartbeat_s``) or any other frame is lost.
    """

    deadline_s: float = 30.0
    verdict_grace_s: float = 10.0
    retransmit_s: float = 0.2
    drain_s: float = 5.0
    in_doubt_s: float = 1.0
    heartbeat_s: float = 1.0
    lease_s: float = 5.0

    def __post_init__(self) -> None:
        for f in fields(self):  # every field is a delay
            require_finite_positive(f"Timings.{f.name}", getattr(self, f.name))
        check_heartbeat(self.heartbeat_s, self.lease_s, "Timings.")

    @property
    def sender_deadline_s(self) -> float:
        return self.deadline_s + self.verdict_grace_s


def check_heartbeat(heartbeat_s: float, lease_s: float, prefix: str) -> None:
    """``ConfigError`` naming ``<prefix>heartbeat_s`` unless it is below ``<prefix>lease_s``
    (a heartbeat renews the lease before it runs out)."""
    if heartbeat_s >= lease_s:
        raise ConfigError(
            f"{prefix}heartbeat_s {heartbeat_s} must be below {prefix}lease_s ({lease_s})"
        )


DEFAULT_TIMINGS = Timings()
"""The defaults of every config that exposes a protocol delay."""


class TimerQueue(Generic[KeyT]):
    """Deadlines by key; ``due(now)`` pops the expired ones in deadline order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, KeyT]] = []
        self._armed: dict[KeyT, tuple[float, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._armed)

    def __contains__(self, key: KeyT) -> bool:
        return key in self._armed

    def arm(self, key: KeyT, when: float) -> float:
        """Arm ``key`` at absolute time ``when``; returns the deadline in force (never later)."""
        if not math.isfinite(when):
            raise InvalidArgumentError(f"timer deadline must be finite, got {when!r}")
        current = self._armed.get(key)
        if current is not None and current[0] <= when:
            return current[0]
        self._seq += 1
        self._armed[key] = (when, self._seq)
        heapq.heappush(self._heap, (when, self._seq, key))
        return when

    def cancel(self, key: KeyT) -> bool:
        return self._armed.pop(key, None) is not None

    def deadline(self, key: KeyT) -> float | None:
        got = self._armed.get(key)
        return None if got is None else got[0]

    def next_deadline(self) -> float | None:
        """The earliest armed deadline (for the caller's poll timeout), or None."""
        while self._heap:
            when, seq, key = self._heap[0]
            if self._armed.get(key) == (when, seq):
                return when
            heapq.heappop(self._heap)
        return None

    def due(self, now: float) -> list[KeyT]:
        """Pop and return every key whose deadline is ``<= now``, earliest first."""
        out: list[KeyT] = []
        while self._heap and self._heap[0][0] <= now:
            when, seq, key = heapq.heappop(self._heap)
            if self._armed.get(key) == (when, seq):
                del self._armed[key]
                out.append(key)
        return out
