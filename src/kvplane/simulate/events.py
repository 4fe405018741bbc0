"""The discrete-event loop: a binary heap of ``(time, seq, kind, a, b)`` tuples.

A plain :mod:`heapq` loop, not simpy: handlers are plain functions indexed by an int ``kind``
with two int arguments, and ties run in scheduling order (``seq``), so a run is deterministic.
Measured against simpy's ``Environment`` in docs/simulate.md ("Event loop"). Owns no model state.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvplane.errors import InvalidArgumentError

Handler = Callable[[int, int], None]

ARRIVE, PREFILL_DONE, SEND, READY, DECODE_DONE, KILL, DETECT, STEP = range(8)
ORDER, ACCEPTED, JOIN, INBOX, LANDED = range(8, 13)
"""The engine's event kinds: each indexes its handler (``Simulation.run``)."""


class EventLoop:
    """Simulated time ``now`` and the pending events; :meth:`run` drains them in time order."""

    __slots__ = ("_heap", "_seq", "now", "processed")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def at(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        """Run handler ``kind`` with ``(a, b)`` at time ``t`` (not before ``now``)."""
        if t < self.now:
            raise InvalidArgumentError(f"event at {t} s is before now ({self.now} s)")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, handlers: Sequence[Handler]) -> None:
        """Pop events in ``(time, seq)`` order and call ``handlers[kind](a, b)`` with ``now``
        set, until none is left; handlers may schedule more."""
        heap = self._heap
        pop = heapq.heappop
        count = 0
        while heap:
            t, _, kind, a, b = pop(heap)
            self.now = t
            handlers[kind](a, b)
            count += 1
        self.processed += count
