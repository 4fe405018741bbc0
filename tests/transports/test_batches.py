"""BatchTable: one sticky terminal transition, pins released once at quiescence, bounded history."""

from __future__ import annotations

import time

import pytest

from kvplane.errors import TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import FailureKind, Handle, Poll, XferKind, XferState
from kvplane.transports.batches import Batch, BatchTable


def _table(history: int = 100) -> tuple[BatchTable, list[tuple[RegionId, ...]], MetricsRegistry]:
    released: list[tuple[RegionId, ...]] = []
    metrics = MetricsRegistry()
    return BatchTable("t", released.append, metrics, history), released, metrics


def test_terminal_state_is_sticky_and_counted():
    table, released, metrics = _table()
    b = table.new(PeerId("p"), XferKind.WRITE, 10, 5.0, (RegionId(1),))
    assert table.finish(b, XferState.FAILED, FailureKind.TIMEOUT, "late")
    assert not table.finish(b, XferState.DONE)
    assert b.poll() == Poll(XferState.FAILED, 0, FailureKind.TIMEOUT, "late")
    assert metrics.value("transport_batches", {"transport": "t", "state": "failed"}, "_total") == 1
    assert metrics.value("transport_batches", {"transport": "t", "state": "done"}, "_total") == 0
    assert released == []  # not quiescent yet: pins held
    assert table.lookup(b.handle) is b


def test_finish_stamps_when_the_batch_ended():
    table, _, _ = _table()
    b = table.new(PeerId("p"), XferKind.WRITE, 10, 5.0, (RegionId(1),))
    assert b.poll().ended_at is None  # pending: no end yet
    before = time.monotonic()
    table.finish(b, XferState.DONE)
    ended = b.poll().ended_at
    assert ended is not None and before <= ended <= time.monotonic()
    table.finish(b, XferState.FAILED)  # refused: the one terminal transition keeps its time
    table.quiesce(b)  # retired into history, which keeps it too
    assert table.lookup(b.handle) == Poll(XferState.DONE, 10)
    assert table.lookup(b.handle).ended_at == ended


def test_quiesce_releases_once_and_retires_into_history():
    table, released, metrics = _table()
    b = table.new(PeerId("p"), XferKind.READ, 7, 5.0, (RegionId(1), RegionId(2)))
    table.quiesce(b)
    table.quiesce(b)
    assert released == [(RegionId(1), RegionId(2))]
    assert table.lookup(b.handle) is b  # still pending: stays live
    table.finish(b, XferState.DONE)
    assert table.live() == []
    assert table.lookup(b.handle) == Poll(XferState.DONE, 7, None, "")
    assert metrics.value("transport_bytes", {"transport": "t", "kind": "read"}, "_total") == 7


def test_committed_batch_ends_in_doubt_and_begin_refuses_ended():
    table, _, _ = _table()
    b = table.new(PeerId("p"), XferKind.WRITE, 1, 5.0, ())
    assert table.begin(b) and table.commit(b)
    table.fail_all([b], FailureKind.REMOTE_DISCONNECT, "gone")
    assert b.state is XferState.IN_DOUBT and b.failure is FailureKind.REMOTE_DISCONNECT
    c = table.new(PeerId("p"), XferKind.WRITE, 1, 5.0, ())
    table.finish(c, XferState.FAILED, FailureKind.CANCELLED)
    assert not table.begin(c) and not table.commit(c) and not c.started


def test_an_early_end_is_failed_only_for_a_batch_that_never_started():
    """Cancel and deadline pass ``doubt_if_started``: a started batch's bytes may still land
    (in a socket, inside an engine call), so only a batch that never began ends FAILED."""
    table, _, _ = _table()
    queued = table.new(PeerId("p"), XferKind.WRITE, 1, 5.0, ())
    running = table.new(PeerId("p"), XferKind.WRITE, 1, 5.0, ())
    assert table.begin(running)
    for b in (queued, running):
        assert table.finish(b, XferState.FAILED, FailureKind.CANCELLED, doubt_if_started=True)
    assert (queued.state, running.state) == (XferState.FAILED, XferState.IN_DOUBT)
    assert running.failure is FailureKind.CANCELLED


def test_fail_all_doubts_started_batches_only_when_asked():
    """Connection loss (default): a started, uncommitted batch FAILED; close passes
    ``doubt_if_started``: its bytes may still move, so IN_DOUBT; never-started stays FAILED."""
    table, _, _ = _table()
    lost, closing, queued = (table.new(PeerId("p"), XferKind.WRITE, 1, 5.0, ()) for _ in "abc")
    assert table.begin(lost) and table.begin(closing)
    table.fail_all([lost], FailureKind.REMOTE_DISCONNECT, "gone")
    table.fail_all([closing, queued], FailureKind.LOCAL_ERROR, "closed", doubt_if_started=True)
    assert [b.state for b in (lost, closing, queued)] == [
        XferState.FAILED, XferState.IN_DOUBT, XferState.FAILED
    ]  # fmt: skip


def test_history_is_bounded_and_foreign_handles_refused():
    table, _, _ = _table(history=2)
    batches = [table.new(PeerId("p"), XferKind.WRITE, 1, 5.0, ()) for _ in range(3)]
    for b in batches:
        table.finish(b, XferState.DONE)
        table.quiesce(b)
    with pytest.raises(TransportError, match="unknown or forgotten handle 1"):
        table.lookup(batches[0].handle)
    assert table.lookup(batches[2].handle).state is XferState.DONE
    with pytest.raises(TransportError, match="not a handle of transport 't'"):
        table.lookup(Handle("other", 3, PeerId("p"), 1))


def test_done_callbacks_run_once_at_the_end_or_at_once_if_it_already_ended():
    table, _, _ = _table()
    b = table.new(PeerId("p"), XferKind.WRITE, 8, 10.0, ())
    calls: list[str] = []
    table.on_done(b.handle, lambda: calls.append("first"))
    table.on_done(b.handle, lambda: calls.append("second"))
    assert calls == []
    assert table.finish(b, XferState.DONE)
    assert calls == ["first", "second"]
    assert not table.finish(b, XferState.FAILED, FailureKind.TIMEOUT, "late")  # no second run
    assert calls == ["first", "second"]
    table.on_done(b.handle, lambda: calls.append("retired"))  # DONE is quiescent: retired
    c = table.new(PeerId("p"), XferKind.WRITE, 8, 10.0, ())
    assert table.finish(c, XferState.FAILED, FailureKind.TIMEOUT, "late")
    table.on_done(c.handle, lambda: calls.append("late"))  # ended, still live: runs at once
    table.quiesce(c)
    table.on_done(c.handle, lambda: calls.append("history"))  # retired: runs at once
    assert calls == ["first", "second", "retired", "late", "history"]
    with pytest.raises(TransportError):
        table.on_done(Handle("t", 999, PeerId("p"), 1), lambda: None)


def test_done_releases_the_pins_before_anyone_can_see_it():
    """The DONE transition itself unpins: a transport that ends a batch DONE without quiescing
    it first still leaves no pin for a poller, ``wait`` or callback to trip over (so a
    deregister right after DONE succeeds whichever transport made the transition)."""
    released: list[tuple[RegionId, ...]] = []
    state_at_release: list[XferState] = []
    batches: list[Batch] = []

    def release(pins: tuple[RegionId, ...]) -> None:
        state_at_release.append(batches[0].state)
        released.append(pins)

    table = BatchTable("t", release, MetricsRegistry())
    b = table.new(PeerId("p"), XferKind.WRITE, 8, 10.0, (RegionId(1), RegionId(2)))
    batches.append(b)
    released_at_done: list[list[tuple[RegionId, ...]]] = []
    table.on_done(b.handle, lambda: released_at_done.append(list(released)))
    assert table.finish(b, XferState.DONE)
    assert state_at_release == [XferState.PENDING]  # released before DONE was visible
    assert released_at_done == [[(RegionId(1), RegionId(2))]]
    assert table.live() == [] and table.lookup(b.handle) == Poll(XferState.DONE, 8)
    table.quiesce(b)  # a transport's own quiesce after DONE is a no-op: released once
    assert released == [(RegionId(1), RegionId(2))]


def test_done_after_quiesce_releases_once_and_doubt_keeps_the_pins():
    table, released, _ = _table()
    b = table.new(PeerId("p"), XferKind.READ, 8, 10.0, (RegionId(3),))
    table.quiesce(b)
    assert table.finish(b, XferState.DONE)
    assert released == [(RegionId(3),)]
    c = table.new(PeerId("p"), XferKind.WRITE, 8, 10.0, (RegionId(4),))
    assert table.begin(c) and table.commit(c)
    assert table.finish(c, XferState.DONE, doubt_if_committed=True)  # turned IN_DOUBT
    assert c.state is XferState.IN_DOUBT and released == [(RegionId(3),)]  # pins held


def test_finish_quiescent_unpins_first_whatever_the_outcome():
    """``quiescent=True``: the caller knows nothing touches the memory, so the pins go before
    the transition (FAILED too), and also for a completion that lost the race to a timeout."""
    table, released, _ = _table()
    b = table.new(PeerId("p"), XferKind.WRITE, 8, 10.0, (RegionId(1),))
    released_at_end: list[int] = []
    table.on_done(b.handle, lambda: released_at_end.append(len(released)))
    assert table.finish(b, XferState.FAILED, FailureKind.BACKEND_ERROR, "x", quiescent=True)
    assert released_at_end == [1] and table.live() == []
    late = table.new(PeerId("p"), XferKind.WRITE, 8, 10.0, (RegionId(2),))
    assert table.finish(late, XferState.FAILED, FailureKind.TIMEOUT, "deadline passed")
    assert released == [(RegionId(1),)]  # a timeout alone keeps the pins
    assert not table.finish(late, XferState.DONE, quiescent=True)  # late, but now quiescent
    assert released == [(RegionId(1),), (RegionId(2),)] and table.live() == []
    assert late.poll().state is XferState.FAILED  # the first transition stays


def test_the_done_event_is_made_on_first_need_and_set_by_the_end():
    """No event is made per batch unless someone waits: one asked for before the end is set
    by ``finish``, one asked for after it is made already set."""
    table, _, metrics = _table()
    early = table.new(PeerId("p"), XferKind.WRITE, 4, 5.0, ())
    late = table.new(PeerId("p"), XferKind.READ, 6, 5.0, ())
    assert early.done_event is None and late.done_event is None
    waiting = table.done_event(early)
    assert not waiting.is_set() and table.done_event(early) is waiting
    table.finish(early, XferState.DONE)
    table.finish(late, XferState.DONE)
    assert waiting.is_set() and late.done_event is None
    assert table.done_event(late).is_set()
    bytes_done = [metrics.value("transport_bytes", {"transport": "t", "kind": k}, "_total")
                  for k in ("write", "read")]  # fmt: skip
    assert bytes_done == [4, 6]  # the counters looked up once per (state, kind) count each
