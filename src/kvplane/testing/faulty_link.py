"""A fault-injecting in-memory link for encoded control frames, on a simulated clock.

:class:`FaultyLink` carries encoded frames between named nodes, applying one seeded
:class:`~kvplane.testing.faults.FrameFaults` fate per frame (corruption is caught where a real
wire would catch it: by the codec's tag). It reads no clock: :meth:`FaultyLink.send` takes
``now`` and :meth:`FaultyLink.due` returns the frames that have arrived by the caller's ``now``.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass

from kvplane.errors import ConfigError
from kvplane.testing.faults import FrameFaults
from kvplane.validators import finite_number


@dataclass(frozen=True, slots=True)
class Delivery:
    """One frame arriving at ``dst`` from ``src``."""

    at: float
    src: str
    dst: str
    frame: bytes


class FaultyLink:
    """Frames in flight between nodes, with seeded drop/duplicate/reorder/delay/corrupt."""

    def __init__(
        self,
        faults: FrameFaults,
        rng: random.Random,
        *,
        latency_s: tuple[float, float] = (0.0005, 0.002),
    ) -> None:
        """``latency_s``: every frame's base delay is uniform in ``[lo, hi]`` finite seconds."""
        lo, hi = (finite_number(x) for x in latency_s)
        if lo is None or hi is None or not 0.0 <= lo <= hi:
            raise ConfigError(f"FaultyLink latency_s needs 0 <= lo <= hi, got {latency_s}")
        self.faults = faults
        self.rng = rng
        self.latency_s = (lo, hi)
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

    def _push(self, now: float, src: str, dst: str, frame: bytes, *, held: bool = False) -> None:
        delay = self.rng.uniform(*self.latency_s)
        if held:
            delay += self.rng.uniform(0.0, self.faults.reorder_s)
        self._seq += 1
        at = now + delay
        heapq.heappush(self._heap, (at, self._seq, Delivery(at, src, dst, frame)))

    def send(self, now: float, src: str, dst: str, frame: bytes) -> None:
        """Put ``frame`` on the wire from ``src`` to ``dst`` at time ``now`` (faults applied)."""
        self.stats["sent"] += 1
        if frozenset((src, dst)) in self._cut:
            self.stats["partitioned"] += 1
            return
        fate = self.faults.pick(self.rng)
        if fate == "drop":
            self.stats["dropped"] += 1
            return
        if fate == "corrupt" and frame:
            buf = bytearray(frame)
            for _ in range(self.rng.randint(1, 3)):
                buf[self.rng.randrange(len(buf))] ^= self.rng.randint(1, 255)
            frame = bytes(buf)
            self.stats["corrupted"] += 1
        elif fate == "reorder":
            self.stats["reordered"] += 1
        self._push(now, src, dst, frame, held=fate == "reorder")
        if fate == "duplicate":
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
