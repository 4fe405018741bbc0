"""MetricsRegistry: prefixing, get-or-create, isolation between registries, the seed's ratios."""

from __future__ import annotations

import socket
import threading
import urllib.request
from functools import partial

import pytest

from kvplane import metrics as m
from kvplane.errors import InvalidArgumentError
from kvplane.metrics import (
    COUNT_BUCKETS,
    MetricsRegistry,
    fallback_ratio,
    overlap_ratio,
    transfer_amplification,
)
from kvplane.testing.cluster import wait_for


def test_prefix_and_get_or_create() -> None:
    reg = MetricsRegistry()
    c = reg.counter("chunk_queries", "chunk lookups", ["tier"])
    assert reg.counter("chunk_queries", "chunk lookups", ["tier"]) is c
    c.labels(tier="host").inc(3)
    assert reg.value("chunk_queries", {"tier": "host"}, suffix="_total") == 3.0
    h = reg.histogram("blocks_per_op", "blocks per op", buckets=COUNT_BUCKETS)
    h.observe(4)
    text = reg.render().decode()
    assert 'kvplane_chunk_queries_total{tier="host"} 3.0' in text
    assert 'kvplane_blocks_per_op_bucket{le="4.0"} 1.0' in text
    assert reg.value("never_set") == 0.0


def test_registries_are_isolated() -> None:
    a, b = MetricsRegistry(), MetricsRegistry()
    a.gauge("pool_used", "used blocks").set(5)
    b.gauge("pool_used", "used blocks").set(7)
    assert a.value("pool_used") == 5.0 and b.value("pool_used") == 7.0


def test_conflicting_redeclaration_and_bad_names() -> None:
    reg = MetricsRegistry()
    reg.counter("x", "x")
    with pytest.raises(InvalidArgumentError, match="already registered"):
        reg.gauge("x", "x")
    with pytest.raises(InvalidArgumentError, match="already registered"):
        reg.counter("x", "x", ["tier"])
    with pytest.raises(InvalidArgumentError, match="metric name"):
        reg.counter("bad-name", "x")


def test_ratios() -> None:
    assert transfer_amplification(150, 100) == 1.5
    assert transfer_amplification(0, 0) == 0.0
    assert transfer_amplification(4096, 0) == float("inf")  # all waste, not "better than ideal"
    assert overlap_ratio(3.0, 4.0) == 0.75
    assert fallback_ratio(1, 4) == 0.25
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        overlap_ratio(5.0, 4.0)
    with pytest.raises(InvalidArgumentError, match="negative"):
        transfer_amplification(-1, 3)


def _hung_up(conn: socket.socket) -> bool:
    """Whether the server closed ``conn`` (end of file or a reset) without a byte of answer;
    False while it is still open. AssertionError if it answered."""
    conn.setblocking(False)
    try:
        data = conn.recv(1)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    assert data == b"", f"a client over the cap was answered: {data!r}"
    return True


def _taken(socks: list[socket.socket], before: int) -> bool:
    """Whether the server gave each of ``socks`` a thread (or dropped one after its timeout)."""
    held = threading.active_count() - before
    return held >= len(socks) or any(_hung_up(s) for s in socks)


def _closed_within_cap(conn: socket.socket, before: int) -> bool:
    """Whether the server closed ``conn``; AssertionError while it serves over the cap."""
    assert threading.active_count() - before <= m.HTTP_MAX_CLIENTS, "served over the cap"
    return _hung_up(conn)


def test_metrics_server_bounds_idle_and_half_sent_clients() -> None:
    """Idle or half-sent ``/metrics`` connections cannot pile up threads: at most
    HTTP_MAX_CLIENTS are served at once (the next ones are closed unanswered), each dropped
    after HTTP_TIMEOUT_S of silence, and a scrape works once they closed. Each connection
    waits for the server's verdict on it (a thread, or closed) before the next one, so the
    listen backlog (5) never overflows into 1 s SYN retries."""
    reg = MetricsRegistry()
    reg.counter("scrapes_test", "a counter").inc()
    server = reg.serve(0)
    port = server.server_address[1]
    before = threading.active_count()
    socks: list[socket.socket] = []
    try:
        for i in range(3 * m.HTTP_MAX_CLIENTS):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metr")  # half a request line, then silence
            socks.append(s)
            if i < m.HTTP_MAX_CLIENTS:  # served: one more thread (or one timed out already)
                wait_for(partial(_taken, socks, before), what=f"client {i} given a thread")
            else:  # over the cap: closed at once (or served in a timed-out one's place)
                wait_for(partial(_closed_within_cap, s, before), what=f"client {i} closed")
        assert threading.active_count() - before <= m.HTTP_MAX_CLIENTS
    finally:
        for s in socks:
            s.close()
    wait_for(lambda: threading.active_count() == before, what="closed clients end their threads")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    assert b"kvplane_scrapes_test_total 1.0" in body
    server.shutdown()
    server.server_close()


def test_a_histogram_travels_as_integer_counters_and_sums_across_processes() -> None:
    from kvplane.metrics import HistogramTotals, histogram_counters

    a, b = MetricsRegistry(), MetricsRegistry()
    for reg, values in ((a, (1, 3)), (b, (3, 9, 600))):
        h = reg.histogram("pd_blocks_per_op", "blocks per op", buckets=(2, 4, 8))
        for v in values:
            h.observe(v)
    got = histogram_counters(a, ["kvplane_pd_blocks_per_op", "kvplane_absent"])
    assert got == {
        "kvplane_pd_blocks_per_op_bucket:2.0": 1, "kvplane_pd_blocks_per_op_bucket:4.0": 2,
        "kvplane_pd_blocks_per_op_bucket:8.0": 2, "kvplane_pd_blocks_per_op_bucket:+Inf": 2,
        "kvplane_pd_blocks_per_op_count": 2, "kvplane_pd_blocks_per_op_sum_nano": 4 * 10**9,
    }  # fmt: skip
    both = [got, histogram_counters(b, ["kvplane_pd_blocks_per_op"])]
    h = HistogramTotals.of("kvplane_pd_blocks_per_op", both)
    assert h.buckets == ((2.0, 1), (4.0, 3), (8.0, 3), (float("inf"), 5))
    assert (h.count, h.sum, h.mean) == (5, 616.0, 616.0 / 5)
    assert h.quantile(0.5) == 2.0 + 2.0 * (2.5 - 1) / 2  # rank 2.5 lies inside (2, 4]
    assert h.quantile(1.0) == 8.0  # the +Inf bucket: its lower bound
    assert h.quantile(0.0) == 0.0
    empty = HistogramTotals.of("kvplane_none", both)
    assert (empty.buckets, empty.count, empty.quantile(0.99)) == ((), 0, 0.0)
    with pytest.raises(InvalidArgumentError, match="quantile must be in"):
        h.quantile(1.5)
