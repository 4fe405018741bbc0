"""A fault-injecting in-memory link for encoded control frames, on a simulated clock.

:class:`FaultyLink` carries *encoded* frames (bytes from :class:`~kvplane.pd.codec.Codec`)
between named nodes, so corruption is caught exactly where it would be on a real wire: by the
codec's tag. Every fault is drawn from one seeded ``random.Random``, so a run is reproducible
from its seed. Faults per frame, in order: drop; corrupt (flip 1-3 random bytes); delay (a
base latency, plus ``reorder_delay_s`` with probability ``reorder`` so later frames overtake);
duplicate (a second copy with its own delay). :meth:`FaultyLink.partition` drops everything
between two nodes until :meth:`FaultyLink.heal` (to simulate peer loss).

The link reads no clock: :meth:`FaultyLink.send` takes ``now`` and frames come out of
:meth:`FaultyLink.due` when the caller's ``now`` reaches their arrival time.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Faults:
    """Per-frame fault probabilities and delays (seconds) of a :class:`FaultyLink`."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    min_delay_s: float = 0.0005
    max_delay_s: float = 0.002
    reorder_delay_s: float = 0.01

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder", "corrupt"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise InvalidArgumentError(
                    f"Faults.{name} must be a probability in [0, 1), got {p}"
                )
        if not 0.0 <= self.min_delay_s <= self.max_delay_s or self.reorder_delay_s < 0:
            raise InvalidArgumentError(
                f"Faults delays need 0 <= min ({self.min_delay_s}) <= max ({self.max_delay_s}) "
                f"and reorder_delay_s >= 0 ({self.reorder_delay_s})"
            )


@dataclass(frozen=True, slots=True)
class Delivery:
    """One frame arriving at ``dst`` from ``src``."""

    at: float
    src: str
    dst: str
    frame: bytes


class FaultyLink:
    """Frames in flight between nodes, with seeded drop/duplicate/reorder/delay/corrupt."""

    def __init__(self, faults: Faults, rng: random.Random) -> None:
        self.faults = faults
        self.rng = rng
        self.stats: Counter[str] = Counter()
        self._heap: list[tuple[float, int, Delivery]] = []
        self._seq = 0
        self._cut: set[frozenset[str]] = set()

    def __len__(self) -> int:
        return len(self._heap)

    def partition(self, a: str, b: str) -> None:
        """Drop every frame between ``a`` and ``b`` (both directions) until :meth:`heal`."""
        self._cut.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        self._cut.discard(frozenset((a, b)))

    def _push(self, now: float, src: str, dst: str, frame: bytes) -> None:
        f = self.faults
        delay = self.rng.uniform(f.min_delay_s, f.max_delay_s)
        if f.reorder and self.rng.random() < f.reorder:
            delay += self.rng.uniform(0.0, f.reorder_delay_s)
            self.stats["reordered"] += 1
        self._seq += 1
        at = now + delay
        heapq.heappush(self._heap, (at, self._seq, Delivery(at, src, dst, frame)))

    def send(self, now: float, src: str, dst: str, frame: bytes) -> None:
        """Put ``frame`` on the wire from ``src`` to ``dst`` at time ``now`` (faults applied)."""
        self.stats["sent"] += 1
        f = self.faults
        if frozenset((src, dst)) in self._cut:
            self.stats["partitioned"] += 1
            return
        if f.drop and self.rng.random() < f.drop:
            self.stats["dropped"] += 1
            return
        if f.corrupt and frame and self.rng.random() < f.corrupt:
            buf = bytearray(frame)
            for _ in range(self.rng.randint(1, 3)):
                buf[self.rng.randrange(len(buf))] ^= self.rng.randint(1, 255)
            frame = bytes(buf)
            self.stats["corrupted"] += 1
        self._push(now, src, dst, frame)
        if f.duplicate and self.rng.random() < f.duplicate:
            self.stats["duplicated"] += 1
            self._push(now, src, dst, frame)

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> list[Delivery]:
        """Frames whose arrival time is ``<= now``, in arrival order."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        self.stats["delivered"] += len(out)
        return out
