"""Batches in flight on one transport: sticky terminal states, deadlines and quiescence.

Pins go only at quiescence; DONE releases them before it is visible. See docs/transports.md.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvplane.errors import TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import (
    DescriptorList,
    FailureKind,
    Handle,
    Peer,
    Poll,
    XferKind,
    XferState,
)


@dataclass(slots=True, eq=False)
class Batch:
    """Mutable record of one submitted batch (guarded by its table's lock)."""

    handle: Handle
    kind: XferKind
    deadline: float
    pins: tuple[RegionId, ...]
    started_at: float
    state: XferState = XferState.PENDING
    failure: FailureKind | None = None
    reason: str = ""
    bytes_done: int = 0
    started: bool = False
    """Some byte may have moved (or the wire was touched) for this batch."""
    committed: bool = False
    """Every byte was handed over; only the peer's confirmation is missing."""
    cancel_requested: bool = False
    quiescent: bool = False
    job: object = None
    ended_at: float | None = None
    done_event: threading.Event | None = None
    """Set when the batch ends; made on first need (:meth:`BatchTable.done_event`)."""
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def poll(self) -> Poll:
        return Poll(self.state, self.bytes_done, self.failure, self.reason, self.ended_at)


@dataclass(slots=True, eq=False)
class Job:
    """A checked, pinned batch a transport is asked to start, and what it moves: the one
    argument of ``TransportCore._start``, which may queue it to its threads as it is."""

    batch: Batch
    src: DescriptorList
    dst: DescriptorList
    peer: Peer
    notify: bytes | None
    handed_off: bool = False
    """Another of the transport's threads now owns the batch's completion and release (a
    stream transport's receiver, for a READ)."""


class BatchTable:
    """The batches of one transport; ``release`` unpins a quiescent batch's regions.

    ``release`` is called at most once per batch, sometimes while the table's lock is held (so
    that a DONE batch is unpinned before its state changes): it must be cheap and must not call
    back into the table."""

    def __init__(
        self,
        transport: str,
        release: Callable[[tuple[RegionId, ...]], None],
        metrics: MetricsRegistry,
        history: int = 100_000,
    ) -> None:
        self._name = transport
        self._release = release
        self._lock = threading.Lock()
        self._live: dict[int, Batch] = {}
        self._history: collections.OrderedDict[int, Poll] = collections.OrderedDict()
        self._history_cap = history
        self._ids = itertools.count(1)
        self._m_batches = metrics.counter(
            "transport_batches", "Batches ended per transport and outcome", ("transport", "state")
        )
        self._m_bytes = metrics.counter(
            "transport_bytes", "Bytes of batches that ended DONE", ("transport", "kind")
        )
        self._m_seconds = metrics.histogram(
            "transport_batch_seconds", "Submit-to-terminal time of batches", ("transport",)
        ).labels(transport)
        self._m_children: dict[tuple[XferState, XferKind], tuple[Any, Any]] = {}
        """Per (state, kind): the labelled batch counter and byte counter (looked up once)."""

    def new(
        self,
        peer_id: PeerId,
        kind: XferKind,
        num_bytes: int,
        deadline_s: float,
        pins: tuple[RegionId, ...],
    ) -> Batch:
        now = time.monotonic()
        handle = Handle(self._name, next(self._ids), peer_id, num_bytes)
        batch = Batch(handle, kind, now + deadline_s, pins, now)
        with self._lock:
            self._live[handle.xfer_id] = batch
        return batch

    def lookup(self, handle: Handle) -> Batch | Poll:
        """The live batch, or the remembered final ``Poll``; ``TransportError`` if unknown."""
        if not isinstance(handle, Handle) or handle.transport != self._name:
            raise TransportError(f"{handle!r} is not a handle of transport {self._name!r}")
        with self._lock:
            batch = self._live.get(handle.xfer_id)
            if batch is not None:
                return batch
            done = self._history.get(handle.xfer_id)
        if done is None:
            raise TransportError(f"unknown or forgotten handle {handle.xfer_id} on {self._name}")
        return done

    def by_id(self, xfer_id: int) -> Batch | None:
        with self._lock:
            return self._live.get(xfer_id)

    def done_event(self, batch: Batch) -> threading.Event:
        """The event set when ``batch`` ends (already set if it has)."""
        with self._lock:
            if batch.done_event is None:
                batch.done_event = threading.Event()
                if batch.state.terminal:
                    batch.done_event.set()
            return batch.done_event

    def on_done(self, handle: Handle, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once when the batch of ``handle`` ends (at once if it has ended).
        ``fn`` must be cheap, thread-safe and not raise. ``TransportError`` if the handle is
        not this table's or is forgotten."""
        found = self.lookup(handle)
        if isinstance(found, Batch):
            with self._lock:
                if not found.state.terminal:
                    found.callbacks.append(fn)
                    return
        fn()

    def begin(self, batch: Batch) -> bool:
        """Mark a batch started (bytes may move from now on); False if it already ended."""
        with self._lock:
            if batch.state.terminal:
                return False
            batch.started = True
            return True

    def commit(self, batch: Batch) -> bool:
        """Mark every byte handed over (a later cancel/timeout yields IN_DOUBT); False if ended."""
        with self._lock:
            if batch.state.terminal:
                return False
            batch.committed = True
            return True

    def finish(
        self,
        batch: Batch,
        state: XferState,
        failure: FailureKind | None = None,
        reason: str = "",
        bytes_done: int | None = None,
        *,
        doubt_if_committed: bool = False,
        doubt_if_started: bool = False,
        quiescent: bool = False,
    ) -> bool:
        """Make the one terminal transition; False (and no state change) if already terminal.
        With ``doubt_if_committed``, a batch whose bytes were all handed over ends IN_DOUBT;
        with ``doubt_if_started``, one whose bytes may have begun to move does.

        A transition to DONE releases the batch's pins (once: a no-op if it was already
        quiescent) before the state changes, so no caller, poller or callback ever sees a DONE
        batch that still pins a region. ``quiescent`` is the caller's word that nothing touches
        the batch's memory any more: the pins then go before the transition whatever the state,
        and also when the batch had already ended (a completion after a cancel or timeout).
        Without it a FAILED or IN_DOUBT batch keeps its pins until :meth:`quiesce`."""
        with self._lock:
            if batch.state.terminal:
                if quiescent and self._quiesce_locked(batch):
                    self._retire_locked(batch)
                return False
            if (doubt_if_committed and batch.committed) or (doubt_if_started and batch.started):
                state = XferState.IN_DOUBT
            if quiescent or state is XferState.DONE:
                self._quiesce_locked(batch)  # unpinned before the state below can be seen
            batch.state = state
            ended = batch.ended_at = time.monotonic()
            batch.failure = failure
            batch.reason = reason
            if bytes_done is not None:
                batch.bytes_done = bytes_done
            elif state is XferState.DONE:
                batch.bytes_done = batch.handle.num_bytes
            self._retire_locked(batch)
            callbacks, batch.callbacks = batch.callbacks, []
            event = batch.done_event
        if event is not None:
            event.set()
        for fn in callbacks:
            fn()
        ended_count, moved = self._counters(state, batch.kind)
        ended_count.inc()
        self._m_seconds.observe(ended - batch.started_at)
        if state is XferState.DONE:
            moved.inc(batch.handle.num_bytes)
        return True

    def _counters(self, state: XferState, kind: XferKind) -> tuple[Any, Any]:
        found = self._m_children.get((state, kind))
        if found is None:  # two threads may both look up: the same children
            found = (self._m_batches.labels(self._name, state.value), None)
            if state is XferState.DONE:
                found = (found[0], self._m_bytes.labels(self._name, kind.value))
            self._m_children[(state, kind)] = found
        return found

    def quiesce(self, batch: Batch) -> None:
        """No thread or engine touches the batch's memory any more: release its pins once.
        The release happens under the table's lock, so a ``finish(DONE)`` racing with it
        cannot make DONE visible between the mark and the release."""
        with self._lock:
            if self._quiesce_locked(batch):
                self._retire_locked(batch)

    def _quiesce_locked(self, batch: Batch) -> bool:
        """Mark the batch quiescent and release its pins, unless already done; True if now."""
        if batch.quiescent:
            return False
        batch.quiescent = True
        self._release(batch.pins)
        return True

    def _retire_locked(self, batch: Batch) -> None:
        if not (batch.quiescent and batch.state.terminal):
            return
        self._live.pop(batch.handle.xfer_id, None)
        self._history[batch.handle.xfer_id] = batch.poll()
        while len(self._history) > self._history_cap:
            self._history.popitem(last=False)

    def live(self, peer_id: PeerId | None = None) -> list[Batch]:
        with self._lock:
            return [
                b for b in self._live.values() if peer_id is None or b.handle.peer_id == peer_id
            ]

    def fail_all(
        self,
        batches: Iterable[Batch],
        failure: FailureKind,
        reason: str,
        *,
        doubt_if_started: bool = False,
    ) -> None:
        """End pending batches: IN_DOUBT if every byte was handed over (or, with
        ``doubt_if_started``, if any byte may have begun to move), else FAILED."""
        for batch in batches:
            self.finish(batch, XferState.FAILED, failure, reason, doubt_if_committed=True,
                        doubt_if_started=doubt_if_started)  # fmt: skip
