"""The KV event feed: each publisher's batches put back in sequence for the prefix index.

:class:`EventFeed` takes decoded frames as they come (live or replayed; dropped, duplicated,
reordered) and applies each worker's batches to a :class:`PrefixIndex` once, in seq order. A
larger incarnation is a restarted worker (its holdings forgotten, seq 0 again); a smaller one is
stale. A batch past a gap waits (``max_pending`` per worker); :meth:`EventFeed.gaps` says whom to
ask a replay from which seq, also when a replay's end said the publisher is ahead (a lost tail).
A batch that starts with ``AllCleared`` (seq 0, a snapshot) stands alone and is applied at once.
No sockets, no clock; not thread-safe. See docs/serving.md ("KV events").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvplane.serving.kv_events import EventBatch, Frame, Origin
from kvplane.serving.router.prefix_index import PrefixIndex
from kvplane.validators import require_int

MAX_PENDING = 4096
"""Batches a worker's stream keeps ahead of its next seq, waiting for the gap to fill."""


@dataclass(slots=True)
class _Stream:
    incarnation: int
    next_seq: int = 0
    known_end: int = 0
    """The publisher's next seq as its latest replay answer said."""
    pending: dict[int, EventBatch] = field(default_factory=dict)


class EventFeed:
    """Sequencing of every publisher's batches into ``index`` (see the module docstring).
    ``counters``: ``applied``, ``duplicates``, ``stale``, ``restarts``, ``overflows``."""

    def __init__(self, index: PrefixIndex, *, max_pending: int = MAX_PENDING) -> None:
        self.index = index
        self.max_pending = require_int("EventFeed.max_pending", max_pending, min=1)
        self.counters: Counter[str] = Counter()
        self._streams: dict[str, _Stream] = {}

    def receive(self, frame: Frame) -> None:
        """Take one frame (see the module docstring)."""
        worker = frame.origin.worker
        st = self._stream(frame.origin)
        if st is None:
            return
        if frame.seq < st.next_seq or (frame.seq in st.pending and not frame.batch.resets):
            self.counters["duplicates"] += 1
            return
        if frame.batch.resets:  # a snapshot under a seq already pending replaces it
            st.pending = {s: b for s, b in st.pending.items() if s > frame.seq}
            self._apply(worker, st, frame.seq, frame.batch)
        elif len(st.pending) >= self.max_pending:
            self.counters["overflows"] += 1
            st.pending.clear()
            return
        else:
            st.pending[frame.seq] = frame.batch
        while st.next_seq in st.pending:
            self._apply(worker, st, st.next_seq, st.pending.pop(st.next_seq))

    def heard(self, origin: Origin, end: int) -> None:
        """A replay answer of ``origin`` ended, its publisher's next seq being ``end``: the
        stream waits until it has applied everything before ``end``."""
        st = self._stream(origin)
        if st is not None:
            st.known_end = max(st.known_end, end)

    def _stream(self, origin: Origin) -> _Stream | None:
        """``origin``'s stream: a new one (the old one's holdings forgotten) for a larger
        incarnation, None (counted ``stale``) for a smaller one."""
        st = self._streams.get(origin.worker)
        if st is None or origin.incarnation > st.incarnation:
            if st is not None:
                self.counters["restarts"] += 1
            self.index.clear(origin.worker)
            st = self._streams[origin.worker] = _Stream(origin.incarnation)
        elif origin.incarnation < st.incarnation:
            self.counters["stale"] += 1
            return None
        return st

    def _apply(self, worker: str, st: _Stream, seq: int, batch: EventBatch) -> None:
        self.index.apply(worker, batch.events)
        st.next_seq = seq + 1
        self.counters["applied"] += 1

    def gaps(self) -> dict[str, int]:
        """Workers whose stream waits on a missing batch, each with the seq to replay from."""
        return {
            w: st.next_seq
            for w, st in self._streams.items()
            if st.pending or st.known_end > st.next_seq
        }

    def position(self, worker: str) -> tuple[int, int] | None:
        """``(incarnation, next seq)`` of ``worker``'s stream; None when never heard from."""
        st = self._streams.get(worker)
        return None if st is None else (st.incarnation, st.next_seq)

    def workers(self) -> list[str]:
        """Every worker heard from, sorted."""
        return sorted(self._streams)

    def forget(self, worker: str) -> None:
        """Drop ``worker``'s stream and holdings (it left the cluster)."""
        self._streams.pop(worker, None)
        self.index.clear(worker)
