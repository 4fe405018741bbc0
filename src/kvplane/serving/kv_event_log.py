"""A KV event publisher's log: sequence numbers, the bounded replay buffer and the holdings.

:class:`EventLog` is the publisher's side without sockets (like ``pd/states``: data in, frames
out), so the property tests drive it as the publisher does. Seq 0 of every incarnation is
``[AllCleared]``; each :meth:`EventLog.append` is the next seq. :meth:`EventLog.replay` answers
a replay request: the buffered frames from the start asked for when the buffer still has it,
else one *snapshot* (``[AllCleared, ChunksStored per tier...]`` under the latest seq: the
holdings after it), which a subscriber applies without the batches before it
(:attr:`EventBatch.resets`). The holdings are the fold of the log's own events.
Not thread-safe: the publisher's thread owns it. See docs/serving.md ("KV events").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from kvplane.ids import ChunkKey
from kvplane.serving.kv_events import (
    END_SEQ,
    AllCleared,
    AnyEvent,
    ChunksRemoved,
    ChunksStored,
    EventBatch,
    encode_batch,
    topic,
)
from kvplane.validators import require_int

RawFrame = tuple[bytes, bytes, bytes]
"""``(topic, seq, payload)`` as it goes on the wire."""


class EventLog:
    """One incarnation's log (see the module docstring). ``buffer_steps``: batches kept for
    replay (at least 1); ``block_size``: tokens per chunk, said in each ``ChunksStored``."""

    def __init__(
        self,
        worker: str,
        incarnation: int,
        *,
        buffer_steps: int = 10_000,
        block_size: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topic = topic(worker, incarnation)
        self.block_size = require_int("EventLog.block_size", block_size, min=0)
        steps = require_int("EventLog.buffer_steps", buffer_steps, min=1)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=steps)
        self._held: dict[str, set[ChunkKey]] = {}
        self._clock = clock
        self.next_seq = 0
        self.snapshots = 0
        self.append([AllCleared()])

    def holdings(self) -> dict[str, frozenset[ChunkKey]]:
        """Each tier's chunks as the log's events say (empty tiers left out)."""
        return {tier: frozenset(keys) for tier, keys in self._held.items() if keys}

    def stored(self, tier: str, keys: Sequence[ChunkKey]) -> ChunksStored:
        """The event that says ``keys`` became readable in ``tier``."""
        return ChunksStored(tuple(keys), tier, block_size=self.block_size)

    def append(self, events: Sequence[AnyEvent]) -> RawFrame:
        """Give ``events`` the next seq, fold them into the holdings and buffer the frame."""
        for ev in events:
            if isinstance(ev, AllCleared):
                self._held.clear()
            elif isinstance(ev, ChunksStored):
                self._held.setdefault(ev.medium, set()).update(map(ChunkKey, ev.block_hashes))
            else:
                self._held.setdefault(ev.medium, set()).difference_update(ev.block_hashes)
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(EventBatch(self._clock(), tuple(events)))
        self._buffer.append((seq, payload))
        return self.topic, seq.to_bytes(8, "big"), payload

    def end_frame(self) -> RawFrame:
        """What ends a replay answer: vLLM's ``[b"", END_SEQ, b""]`` but with the topic and
        the next seq in the payload frame, so the asker learns the incarnation and how far the
        log goes (a vLLM client reads only the seq)."""
        return self.topic, END_SEQ, self.next_seq.to_bytes(8, "big")

    def replay(self, start: int) -> list[RawFrame]:
        """The answer to a replay from seq ``start``: the buffered frames ``>= start`` when
        the buffer still holds ``start`` (none when ``start`` is past the latest seq), else
        one snapshot frame under the latest seq (see the module docstring)."""
        oldest = self._buffer[0][0]
        if start >= oldest:
            return [(self.topic, s.to_bytes(8, "big"), p) for s, p in self._buffer if s >= start]
        self.snapshots += 1
        events: list[AnyEvent] = [AllCleared()]
        events += [self.stored(t, sorted(keys)) for t, keys in sorted(self._held.items()) if keys]
        payload = encode_batch(EventBatch(self._clock(), tuple(events)))
        return [(self.topic, (self.next_seq - 1).to_bytes(8, "big"), payload)]


def coalesce(changes: Sequence[tuple[str, ChunkKey, bool]], log: EventLog) -> list[AnyEvent]:
    """``(tier, key, stored)`` changes in order as events: each run of one kind in one tier
    becomes one event with the run's keys in order."""
    out: list[AnyEvent] = []
    start = 0
    for i in range(1, len(changes) + 1):
        if i == len(changes) or changes[i][::2] != changes[start][::2]:
            tier, _key, stored = changes[start]
            keys = [key for _t, key, _s in changes[start:i]]
            out.append(log.stored(tier, keys) if stored else ChunksRemoved(tuple(keys), tier))
            start = i
    return out
