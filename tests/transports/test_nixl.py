"""nixl adapter specifics (skipped without NIXL): address arithmetic, tagging, empty batches,
and the poster thread (``submit`` never waits for NIXL to copy)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvplane.errors import TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.transports.base import DescriptorList, FailureKind, XferKind, XferState
from kvplane.transports.nixl import PROGRESS_DELAY_US, addresses, make_agent, probe

pytestmark = pytest.mark.skipif(probe() is not None, reason=str(probe()))


def test_addresses_are_base_plus_offset():
    descs = DescriptorList.of([(2, 5, 10), (1, 0, 3), (2, 0, 1)])
    rows = addresses({RegionId(1): 1000, RegionId(2): 5000}, descs)
    assert rows.dtype == np.uint64
    assert rows.tolist() == [[5005, 10, 0], [1000, 3, 0], [5000, 1, 0]]


def test_loopback_write_and_notify_only_batch(kit):
    from kvplane.transports.nixl import NixlTransport

    t = NixlTransport(agent="nixl-loop")
    try:
        src = t.register(torch.arange(64, dtype=torch.uint8)).region_id
        dst_buf = torch.zeros(64, dtype=torch.uint8)
        dst = t.register(dst_buf).region_id
        peer = t.connect(t.metadata())
        h = t.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(dst, 32, 32), peer, notify=b"")
        assert kit.wait(t, h).state is XferState.DONE
        assert dst_buf[32:].tolist() == list(range(32)) and int(dst_buf[:32].sum()) == 0
        h = t.submit(XferKind.WRITE, DescriptorList.empty(), DescriptorList.empty(), peer,
                     notify=b"only")  # fmt: skip
        assert kit.wait(t, h).state is XferState.DONE
        notes: list[tuple[PeerId, bytes]] = []
        end = time.monotonic() + 10
        while len(notes) < 2 and time.monotonic() < end:
            notes += t.notifications()
            time.sleep(1e-3)
        assert sorted(notes) == [(PeerId("nixl-loop"), b""), (PeerId("nixl-loop"), b"only")]
        assert t.pinned_regions() == 0 and t.live_batches() == 0
    finally:
        t.close()


class _FakeApi:
    """The names of ``nixl._api`` that :func:`make_agent` uses, recording what it does."""

    def __init__(self, *modes: str, bind: bool = True) -> None:
        self.nixl_thread_sync_t = SimpleNamespace(**{m: SimpleNamespace(value=m) for m in modes})
        self.made: list[tuple[str, dict[str, object]]] = []
        if bind:
            engine = lambda name, cfg: ("engine", name, cfg)  # noqa: E731
            self.nixlBind = SimpleNamespace(nixlAgentConfig=SimpleNamespace, nixlAgent=engine)

    @staticmethod
    def nixl_agent_config(**kw: object) -> dict[str, object]:
        return kw

    def nixl_agent(self, name: str, config: dict[str, object]) -> SimpleNamespace:
        self.made.append((name, config))
        shell = SimpleNamespace(agent=("own", name), backends=[])
        shell.create_backend = lambda b, params: shell.backends.append((b, params, shell.agent))
        return shell


def test_make_agent_sets_thread_sync_and_a_progress_delay_before_any_backend():
    api = _FakeApi("NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_RW")
    agent, delayed = make_agent(api, "a1", ["UCX"])
    assert delayed is True
    [(name, shell_config)] = api.made
    assert name == "a1" and shell_config["backends"] == []  # no engine work on the shell's
    assert shell_config["enable_prog_thread"] is False
    kind, engine_name, cfg = agent.agent
    assert (kind, engine_name) == ("engine", "a1")
    assert cfg.pthrDelay == PROGRESS_DELAY_US > 0 and cfg.useProgThread is True
    assert cfg.syncMode == "NIXL_THREAD_SYNC_RW" and cfg.useListenThread is False
    assert agent.backends == [("UCX", {}, agent.agent)]  # created on the configured engine


def test_make_agent_falls_back_to_strict_and_to_the_wrappers_own_config():
    older = _FakeApi("NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT")
    agent, _ = make_agent(older, "a2", ["UCX"])
    assert agent.agent[2].syncMode == "NIXL_THREAD_SYNC_STRICT"
    bare = _FakeApi("NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT", bind=False)
    agent, delayed = make_agent(bare, "a3", ["UCX"])
    assert delayed is False and agent.agent == ("own", "a3")
    strict = SimpleNamespace(value="NIXL_THREAD_SYNC_STRICT")
    assert bare.made == [("a3", {"backends": ["UCX"], "sync_mode": strict})]


def test_real_agent_gets_the_progress_delay():
    from kvplane.transports.nixl import NixlTransport

    t = NixlTransport(agent="nixl-delay")
    try:
        assert t.progress_delay_set is True
    finally:
        t.close()


class _GatedTransfer:
    """Wraps the agent's ``transfer``: records the calling thread, then waits for ``gate``."""

    def __init__(self, agent: object) -> None:
        self.inner = agent.transfer  # type: ignore[attr-defined]
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []

    def __call__(self, handle: object) -> str:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(20)
        return str(self.inner(handle))


def _gated_loopback(agent: str, src_buf: torch.Tensor, dst_buf: torch.Tensor):
    """A loopback NIXL transport with both buffers registered and its ``transfer`` gated."""
    from kvplane.transports.nixl import NixlTransport

    t = NixlTransport(agent=agent)
    src, dst = t.register(src_buf).region_id, t.register(dst_buf).region_id
    peer = t.connect(t.metadata())
    gated = _GatedTransfer(t._agent)
    t._agent.transfer = gated
    return t, src, dst, peer, gated


def test_submit_returns_while_nixl_copies_and_batches_keep_order(kit):
    src_buf = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    dst_buf = torch.zeros(256, dtype=torch.uint8)
    t, src, dst, peer, gated = _gated_loopback("nixl-gate", src_buf, dst_buf)
    try:
        h1 = t.submit(XferKind.WRITE, kit.one(src, 0, 128), kit.one(dst, 0, 128), peer)
        h2 = t.submit(XferKind.WRITE, kit.one(src, 128, 128), kit.one(dst, 128, 128), peer,
                      notify=b"second")  # fmt: skip
        assert gated.entered.wait(10)  # the poster is inside NIXL's transfer of h1 ...
        assert t.poll(h1).state is XferState.PENDING and t.poll(h2).state is XferState.PENDING
        assert int(dst_buf.sum()) == 0 and gated.threads == ["kvplane-nixl-nixl-gate-post"]
        gated.gate.set()  # ... and submit returned without waiting for it
        assert kit.wait(t, h1).state is XferState.DONE
        assert kit.wait(t, h2).state is XferState.DONE
        assert gated.threads == ["kvplane-nixl-nixl-gate-post"] * 2
        assert torch.equal(dst_buf, src_buf)
        assert t.pinned_regions() == 0 and t.live_batches() == 0
    finally:
        t.close()
    assert not [name for name in kit.kv_threads() if "nixl-gate" in name]


def test_cancel_while_nixl_copies_ends_at_once_and_unpins_when_nixl_lets_go(kit):
    dst_buf = torch.zeros(64, dtype=torch.uint8)
    t, src, dst, peer, gated = _gated_loopback(
        "nixl-cancel", torch.full((64,), 7, dtype=torch.uint8), dst_buf
    )
    try:
        running = t.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(dst, 0, 32), peer)
        queued = t.submit(XferKind.WRITE, kit.one(src, 32, 32), kit.one(dst, 32, 32), peer)
        assert gated.entered.wait(10)
        t.cancel(running)
        t.cancel(queued)
        # the running one's copy goes on inside NIXL: in doubt; the queued one never moved
        for h, state in ((running, XferState.IN_DOUBT), (queued, XferState.FAILED)):
            got = t.poll(h)
            assert (got.state, got.failure) == (state, FailureKind.CANCELLED)
        with pytest.raises(TransportError):  # NIXL still owns the running batch's bytes
            t.deregister(src)
        gated.gate.set()
        kit.settle(t, 10)
        assert gated.threads == ["kvplane-nixl-nixl-cancel-post"]  # the queued one never ran
        assert int(dst_buf[32:].sum()) == 0
        t.deregister(src)
    finally:
        t.close()


def test_close_fails_queued_batches_and_stops_the_poster(kit):
    ones, zeros = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    t, src, dst, peer, gated = _gated_loopback("nixl-close", ones, zeros)
    first = t.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(dst, 0, 32), peer)
    second = t.submit(XferKind.WRITE, kit.one(src, 32, 32), kit.one(dst, 32, 32), peer)
    assert gated.entered.wait(10)
    closer = threading.Thread(target=t.close)
    closer.start()
    end = time.monotonic() + 10
    while not t.poll(second).state.terminal and time.monotonic() < end:  # close failed it
        time.sleep(1e-3)
    gated.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert t.poll(second).state is XferState.FAILED
    assert t.poll(first).state.terminal
    assert t.pinned_regions() == 0 and t.live_batches() == 0
    assert not [name for name in kit.kv_threads() if "nixl-close" in name]


def test_a_poster_error_fails_its_batch_and_the_poster_keeps_going(kit, monkeypatch):
    src_buf = torch.arange(64, dtype=torch.int64).to(torch.uint8)
    dst_buf = torch.zeros(64, dtype=torch.uint8)
    t, src, dst, peer, gated = _gated_loopback("nixl-bug", src_buf, dst_buf)
    gated.gate.set()
    begin = t._batches.begin
    calls = []

    def broken_once(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return begin(batch)

    monkeypatch.setattr(t._batches, "begin", broken_once)
    try:
        bad = t.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(dst, 0, 32), peer)
        good = t.submit(XferKind.WRITE, kit.one(src, 32, 32), kit.one(dst, 32, 32), peer)
        got = kit.wait(t, bad)
        assert (got.state, got.failure) == (XferState.FAILED, FailureKind.LOCAL_ERROR)
        assert "a bug" in got.reason
        assert kit.wait(t, good).state is XferState.DONE
        assert torch.equal(dst_buf[32:], src_buf[32:]) and int(dst_buf[:32].sum()) == 0
        assert t.pinned_regions() == 0 and t.live_batches() == 0
    finally:
        t.close()


def test_addresses_refuse_a_region_they_have_no_base_for():
    bases = {RegionId(1): 1000, RegionId(3): 9000}
    for regions in ([2], [1, 4], [0]):
        descs = DescriptorList.of([(r, 0, 1) for r in regions])
        with pytest.raises(TransportError, match="no base address"):
            addresses(bases, descs)
    with pytest.raises(TransportError):
        addresses({}, DescriptorList.of([(1, 0, 1)]))
    assert addresses({}, DescriptorList.empty()).shape == (0, 3)


def test_loopback_destination_is_pinned_while_nixl_may_write_it(kit):
    dst_buf = torch.zeros(64, dtype=torch.uint8)
    t, src, dst, peer, gated = _gated_loopback("nixl-pin", torch.ones(64, dtype=torch.uint8),
                                               dst_buf)  # fmt: skip
    try:
        h = t.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer)
        assert gated.entered.wait(10)
        with pytest.raises(TransportError, match="in use"):  # our own memory, NIXL writes it
            t.deregister(dst)
        gated.gate.set()
        assert kit.wait(t, h).state is XferState.DONE
        assert int(dst_buf.sum()) == 64 and t.pinned_regions() == 0
        t.deregister(dst)
    finally:
        t.close()


def test_a_queued_write_keeps_the_peer_table_it_was_checked_against(kit):
    """A ``connect`` that refreshes the peer's table while a write waits for the poster does
    not re-aim it: the write goes where it was checked to go, or fails; it never lands in a
    neighbouring region (before: region 2 gone from the table, its bytes went to region 3)."""
    from kvplane.transports.nixl import NixlTransport

    a, b = NixlTransport(agent="nixl-tab-a"), NixlTransport(agent="nixl-tab-b")
    try:
        src = a.register(torch.full((64,), 7, dtype=torch.uint8)).region_id
        bufs = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
        r1, r2, _r3 = (b.register(x).region_id for x in bufs)
        peer = a.connect(b.metadata())
        gated = _GatedTransfer(a._agent)
        a._agent.transfer = gated
        first = a.submit(XferKind.WRITE, kit.one(src, 0, 8), kit.one(r1, 0, 8), peer)
        assert gated.entered.wait(10)  # the poster is busy: the next write waits in the queue
        queued = a.submit(XferKind.WRITE, kit.one(src, 8, 16), kit.one(r2, 16, 16), peer)
        b.deregister(r2)
        a.connect(b.metadata())  # refreshed: b now has regions r1 and r3 only
        gated.gate.set()
        assert kit.wait(a, first).state is XferState.DONE
        got = kit.wait(a, queued).state  # NIXL may refuse the dropped region, or write it
        assert got is XferState.FAILED or bufs[1][16:32].tolist() == [7] * 16
        assert int(bufs[2].sum()) == 0  # never the neighbour
        assert a.pinned_regions() == 0 and a.live_batches() == 0
    finally:
        a.close()
        b.close()


def _loopback(agent: str):
    """A loopback NIXL transport with a 64-byte source of ones and destination of zeros."""
    from kvplane.transports.nixl import NixlTransport

    t = NixlTransport(agent=agent)
    src = t.register(torch.ones(64, dtype=torch.uint8)).region_id
    dst = t.register(torch.zeros(64, dtype=torch.uint8)).region_id
    return t, src, dst, t.connect(t.metadata())


def _wait_posted(t, handle) -> None:
    """Until the poster has handed the batch to NIXL (it is committed)."""
    end = time.monotonic() + 10
    while not t._batches.lookup(handle).committed and time.monotonic() < end:
        time.sleep(1e-3)


def _posted_then_pending(t):
    """Make NIXL's requests look running (``PROC``) after they were really posted, until
    ``hold`` is cleared; returns that event."""
    hold = threading.Event()
    hold.set()
    agent = t._agent
    transfer, check = agent.transfer, agent.check_xfer_state

    def posted(handle):
        transfer(handle)
        return "PROC"

    agent.transfer = posted
    agent.check_xfer_state = lambda h: "PROC" if hold.is_set() else check(h)
    return hold


def test_cancel_after_nixl_has_the_bytes_ends_in_doubt(kit):
    t, src, dst, peer = _loopback("nixl-doubt")
    try:
        hold = _posted_then_pending(t)
        h = t.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer)
        _wait_posted(t, h)
        t.cancel(h)
        got = t.poll(h)
        assert (got.state, got.failure) == (XferState.IN_DOUBT, FailureKind.CANCELLED)
        hold.clear()
        kit.settle(t, 10)
    finally:
        t.close()


def test_a_done_batch_is_released_before_anyone_sees_it_done(kit):
    t, src, dst, peer = _loopback("nixl-rel")
    try:
        release, refusals = t._agent.release_xfer_handle, []

        def refuse_twice(handle):
            if len(refusals) < 2:
                refusals.append(handle)
                raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
            return release(handle)

        t._agent.release_xfer_handle = refuse_twice
        h = t.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer)
        seen: list[int] = []
        t.on_done(h, lambda: seen.append(t.pinned_regions()))
        assert kit.wait(t, h).state is XferState.DONE
        assert len(refusals) == 2 and seen == [0]  # unpinned before it turned DONE
    finally:
        t.close()


def test_close_asks_nixl_again_until_it_lets_go_of_a_running_request(kit):
    t, src, dst, peer = _loopback("nixl-shut")
    _posted_then_pending(t)  # stays "running" for good
    release, calls = t._agent.release_xfer_handle, []

    def busy_thrice(handle):
        calls.append(handle)
        if len(calls) <= 3:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        return release(handle)

    t._agent.release_xfer_handle = busy_thrice
    h = t.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer)
    _wait_posted(t, h)
    t.close()
    assert len(calls) == 4  # released (cancelled) before close deregistered the memory
    assert t.poll(h).state is XferState.IN_DOUBT
    assert not [name for name in kit.kv_threads() if "nixl-shut" in name]


def test_a_poster_error_after_the_batch_started_ends_it_in_doubt(kit, monkeypatch):
    """Once ``begin`` marked the batch started NIXL may be moving its bytes: a bug of ours
    from then on cannot say FAILED (which would let the caller reuse the memory)."""
    src_buf = torch.arange(64, dtype=torch.int64).to(torch.uint8)
    dst_buf = torch.zeros(64, dtype=torch.uint8)
    t, src, dst, peer, gated = _gated_loopback("nixl-bug-late", src_buf, dst_buf)
    gated.gate.set()
    end_batch = t._end
    calls = []

    def broken_once(batch, state, exc=None):
        calls.append(state)
        if len(calls) == 1:
            assert batch.started  # the error comes after begin (and after NIXL's transfer)
            raise RuntimeError("a late bug")
        return end_batch(batch, state, exc)

    monkeypatch.setattr(t, "_end", broken_once)
    try:
        bad = t.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(dst, 0, 32), peer)
        got = kit.wait(t, bad)
        assert (got.state, got.failure) == (XferState.IN_DOUBT, FailureKind.LOCAL_ERROR)
        assert "a late bug" in got.reason
        good = t.submit(XferKind.WRITE, kit.one(src, 32, 32), kit.one(dst, 32, 32), peer)
        assert kit.wait(t, good).state is XferState.DONE  # the poster went on
        kit.settle(t, 10)
    finally:
        t.close()


class _StuckTransfer:
    """An agent ``transfer`` that blocks until ``gate`` and then reports an error without
    touching NIXL (the memory is deregistered by then)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, handle: object) -> str:
        self.entered.set()
        assert self.gate.wait(30)
        return "ERR"


def test_close_while_the_poster_is_stuck_in_transfer_ends_the_batch_in_doubt(kit, monkeypatch):
    """close gives up on the poster after CLOSE_JOIN_S; the batch it is posting has started
    (NIXL may still write its memory), so close must not end it FAILED."""
    from kvplane.transports import nixl

    monkeypatch.setattr(nixl, "CLOSE_JOIN_S", 0.2)
    monkeypatch.setattr(nixl, "CLOSE_RELEASE_S", 0.2)
    ones, zeros = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    t, src, dst, peer, _ = _gated_loopback("nixl-stuck", ones, zeros)
    stuck = _StuckTransfer()
    t._agent.transfer = stuck
    poster = t._poster.thread
    try:
        running = t.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(dst, 0, 32), peer)
        queued = t.submit(XferKind.WRITE, kit.one(src, 32, 32), kit.one(dst, 32, 32), peer)
        assert stuck.entered.wait(10)
        t.close()
        assert poster.is_alive()  # close returned while the poster is still inside transfer
        got = t.poll(running)
        assert (got.state, got.failure) == (XferState.IN_DOUBT, FailureKind.LOCAL_ERROR)
        assert t.poll(queued).state is XferState.FAILED  # never started: nothing moved
    finally:
        stuck.gate.set()
        poster.join(10)
    assert not poster.is_alive()
