"""What every worker guarantees: each order is answered; a stats reply fits in one frame."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.pipeline.timeline import Mark
from kvplane.serving.messages import (
    AnyMessage,
    DecodeOrder,
    ErrorReply,
    InfoQuery,
    PrefillOrder,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import TEST_SECRET, check_balanced, cluster


def test_an_order_that_fails_unexpectedly_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    with cluster() as c:

        def boom(*args: object) -> str:
            raise RuntimeError("surprise")

        monkeypatch.setattr(c.decode, "_accept", boom)
        monkeypatch.setattr(c.prefill, "_accept", boom)
        dec = DecodeOrder(request_id="a", session_id="s", prefill_peer="prefill", token_ids=(1,))
        pre = PrefillOrder(request_id="a", session_id="s", decode_peer="decode", token_ids=(1,))
        for w, order in ((c.router.decode[0], dec), (c.router.prefill[0], pre)):
            got = w.client.call(order, timeout_s=3)
            assert got == ErrorReply(reason="internal error: RuntimeError: surprise")
        assert (c.decode.counters["order_errors"], c.prefill.counters["order_errors"]) == (1, 1)
        assert c.decode.counters["loop_errors"] == c.prefill.counters["loop_errors"] == 0


def test_out_of_range_token_ids_are_refused_not_dropped() -> None:
    with cluster() as c:
        big = 1 << 63
        dec = DecodeOrder(request_id="b", session_id="s", prefill_peer="prefill", token_ids=(big,))
        pre = PrefillOrder(request_id="a", session_id="s", decode_peer="decode", token_ids=(big,))
        for w, order in ((c.router.decode[0], dec), (c.router.prefill[0], pre)):
            got: AnyMessage = w.client.call(order, timeout_s=3)
            assert isinstance(got, ErrorReply) and "token_ids[0]" in got.reason
        assert c.decode.counters["loop_errors"] == c.prefill.counters["loop_errors"] == 0
        check_balanced(c.router)


def test_a_stats_reply_keeps_the_newest_events_that_fit_in_a_frame() -> None:
    c = cluster()
    limit = 256 << 10
    client = RpcClient(c.decode.address, timeout_s=3.0, max_frame=limit, secret=TEST_SECRET)
    try:
        c.decode.rpc.max_frame = limit  # the worker fits its replies to its frame limit
        for i in range(4000):  # ~150 bytes each: well over the limit in all
            c.decode.timeline.record(Mark.ORDER, f"{i:0100d}", detail="x" * 20)
        got = client.call(StatsQuery(timeline=True))
        assert isinstance(got, WorkerStats)
        assert 0 < len(got.timeline) < 4000 and got.timeline_truncated == 4000 - len(got.timeline)
        assert got.timeline[-1]["request_id"] == f"{3999:0100d}"  # the newest are kept
        assert len(msgspec.msgpack.encode(got)) <= limit
        assert isinstance(client.call(InfoQuery()), WorkerInfo)  # the connection survived
        plain = client.call(StatsQuery())
        assert isinstance(plain, WorkerStats) and plain.timeline_truncated == 0
    finally:
        client.close()
        c.close()
