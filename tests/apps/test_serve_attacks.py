"""A hostile local process against real ``kvplane serve`` workers that share a secret: it can
neither read nor write KV over their tcp data planes, and a flood of connections that never
authenticate (200 silent ones held on each worker's PD endpoint and data plane) does not keep
the pair apart."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import msgspec
import pytest

from kvplane.errors import TransportError
from kvplane.serving.messages import Generate, RequestResult, StatsQuery, WorkerStats
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import TEST_SECRET, Proc, free_port
from kvplane.transports.base import DescriptorList
from kvplane.transports.tcp import TcpTransport
from kvplane.transports.wire import (
    HEADER,
    WIRE_VERSION,
    FrameType,
    Metadata,
    encode,
    pack_header,
    pack_table,
    parse_header,
)

JUNK = 200
"""Silent connections held open on each listener under attack."""
PAIR_S = 10.0
"""The bound: a request succeeds within this long of the router's start (pairing, the data
plane's handshake and one request; the junk's own lifetime is 5 s on the PD endpoint)."""
FIRST_BYTE_S = 30.0
"""The data planes' first-byte timeout (``--first-byte-timeout``): past the handshake's 10 s,
so the junk there is held, handshaking, until that deadline (1 s by default)."""
SHAPE = ["--layout", "mla", "--layers", "2", "--latent-dim", "32", "--rope-dim", "16"]
TIMING = ["--heartbeat", "0.1", "--lease", "1", "--retransmit", "0.05", "--deadline", "5"]


def _worker(name: str, metrics: int) -> Proc:
    args = ["--name", name, "--control", f"tcp://127.0.0.1:{free_port()}", *SHAPE, *TIMING]
    args += ["--pd", f"tcp://127.0.0.1:{free_port()}", "--num-blocks", "128"]
    args += ["--first-byte-timeout", str(FIRST_BYTE_S), "--metrics-port", str(metrics)]
    return Proc(name, args)


def _data_plane(proc: Proc, metrics: int) -> int:
    """The port of ``proc``'s tcp data plane: what it listens on besides its order socket, PD
    endpoint and ``/metrics``."""
    known = {_port(proc.control), _port(str(proc.info["pd"])), metrics}
    data = _listening_ports(proc.proc.pid) - known
    assert len(data) == 1, data
    return data.pop()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (from ``/proc``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _scrape(port: int, name: str) -> dict[str, float]:
    """Every sample of metric ``name`` on ``/metrics`` at ``port``, by its label text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
    return {m[1] or "": float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def _stats(control: str) -> dict[str, int]:
    client = RpcClient(control, timeout_s=15.0, secret=TEST_SECRET)
    try:
        stats = client.call(StatsQuery())
        assert isinstance(stats, WorkerStats)
        return dict(stats.counters)
    finally:
        client.close()


def _router(workers: list[tuple[Proc, int]]) -> tuple[Proc, RpcClient]:
    (pre, _), (dec, _) = workers
    router = Proc("router", ["--prefill", pre.control, "--decode", dec.control, "--refresh", "0.5"])
    return router, RpcClient(router.control, timeout_s=15.0, secret=TEST_SECRET)


def _served(client: RpcClient, tag: str) -> None:
    """Requests until one succeeds (``PAIR_S`` at most), then five more: all token-exact."""
    start, failures = time.monotonic(), list[str]()
    while True:
        got = client.call(Generate(request_id=f"{tag}{len(failures)}", token_ids=tuple(range(40))))
        if isinstance(got, RequestResult) and got.state == "success":
            break
        failures.append(str(got)[:200])
        assert time.monotonic() - start < PAIR_S, failures[-3:]
        time.sleep(0.1)
    assert got.mismatches == 0
    for i in range(5):
        again = client.call(Generate(request_id=f"{tag}-more{i}", token_ids=tuple(range(48))))
        assert isinstance(again, RequestResult) and again.state == "success"
        assert again.mismatches == 0


def _unanswered(port: int, frames: bytes) -> bytes:
    """Every byte the listener at ``port`` sends back to ``frames`` before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(frames)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while data := s.recv(4096):
                got += data
    return got


def _challenged(port: int, auth: dict[str, object]) -> tuple[bytes, bytes]:
    """A HELLO without a secret: the CHALLENGE's bytes, then all that follows ``auth``."""
    hello = msgspec.msgpack.encode(
        {"version": WIRE_VERSION, "transport": "tcp", "nonce": bytes(32)}
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(pack_header(FrameType.HELLO, 0, len(hello)) + hello)
        got = b""
        while (
            len(got) < HEADER.size
            or len(got) < HEADER.size + parse_header(got[: HEADER.size]).length
        ):
            data = s.recv(4096)
            assert data, f"closed after {len(got)} bytes"
            got += data
        assert parse_header(got[: HEADER.size]).ftype is FrameType.CHALLENGE
        body = msgspec.msgpack.encode(auth)
        s.sendall(pack_header(FrameType.AUTH, 0, len(body)) + body)
        after = b""
        with contextlib.suppress(ConnectionResetError):
            while data := s.recv(4096):
                after += data
    return got, after


def test_a_process_without_the_secret_can_neither_read_nor_write_kv_over_the_data_plane(
    flooded: tuple[list[tuple[Proc, int]], list[socket.socket]],
) -> None:
    """Finding 1 of #27 used a tcp handshake with an empty MAC, then ``READ_REQ`` on the
    prefill worker's KV region (other requests' KV came back) and ``DATA`` + ``COMMIT`` over
    the decode worker's region (ACKed, and the next request reused the poisoned prefix). With
    the secret every one of those gets not a byte back, a transport without the secret or with
    another is refused, nothing names a worker to the stranger, and requests stay exact."""
    workers, _ = flooded
    router, client = _router(workers)
    try:
        _served(client, "before")
        table = pack_table(DescriptorList.of([(0, 0, 4096)]))
        read = pack_header(FrameType.READ_REQ, 1, len(table), 1) + table
        write = pack_header(FrameType.DATA, 2, len(table) + 4096, 1) + table + b"\xee" * 4096
        write += pack_header(FrameType.COMMIT, 2, 0)
        for proc, metrics in workers:
            port = _data_plane(proc, metrics)
            assert _unanswered(port, read) == b"" and _unanswered(port, write) == b""
            got, after = _challenged(port, {"agent": "thief", "target": "", "mac": b""})
            assert after == b"" and proc.info["name"].encode() not in got  # type: ignore[union-attr]
            meta = encode(
                Metadata(WIRE_VERSION, "tcp", str(proc.info["name"]), f"127.0.0.1:{port}")
            )
            for secret in (None, b"another secret entirely, 32 bytes"):
                thief = TcpTransport(secret=secret, agent="thief")
                try:
                    with pytest.raises(TransportError, match="authentication failed"):
                        thief.connect(meta)
                finally:
                    thief.close()
        _served(client, "after")
    finally:
        client.close()
        router.stop()
    for _, metrics in workers:
        dropped = _scrape(metrics, "kvplane_stream_connections_dropped_total")
        assert dropped['{reason="handshake_failed",transport="tcp"}'] == 5


@pytest.fixture
def flooded(
    start_procs: Callable[..., list[Proc]], stop_procs: Callable[[Sequence[Proc]], None]
) -> Iterator[tuple[list[tuple[Proc, int]], list[socket.socket]]]:
    """The prefill and decode workers (started at once) with their metrics ports, and a list
    of the test's junk connections, closed before the workers stop."""
    started: list[Proc] = []
    junk: list[socket.socket] = []
    try:
        metrics = [free_port(), free_port()]
        names = ("prefill", "decode")
        start_procs(started, *[partial(_worker, n, m) for n, m in zip(names, metrics, strict=True)])
        yield list(zip(started, metrics, strict=True)), junk
    finally:
        for conn in junk:
            conn.close()
        stop_procs(started)


def test_a_pair_forms_and_serves_while_junk_is_held_on_every_pd_and_data_plane_listener(
    flooded: tuple[list[tuple[Proc, int]], list[socket.socket]],
) -> None:
    """Before, the PD endpoint held its 64 first connections, junk or not, until their zmq
    handshake timed out, and cut every later one: a decode worker could not reach a flooded
    prefill endpoint while the flood lasted. Now a newcomer evicts the oldest connection that
    has not proven the key, so the pair forms, the data planes connect past their own junk
    (evicting the oldest handshake) and requests are token-exact within the bound."""
    workers, junk = flooded
    for proc, metrics in workers:
        for port in (_port(str(proc.info["pd"])), _data_plane(proc, metrics)):
            junk += [socket.create_connection(("127.0.0.1", port)) for _ in range(JUNK)]
    router, client = _router(workers)
    try:
        _served(client, "r")
    finally:
        client.close()
        router.stop()
    for proc, metrics in workers:
        counters = _stats(proc.control)
        assert counters["evicted_connections"] >= JUNK - 64  # the flood reached the door
        assert counters.get("refused_connections", 0) == 0
        dropped = _scrape(metrics, "kvplane_stream_connections_dropped_total")
        assert dropped.get('{reason="evicted",transport="tcp"}', 0) >= JUNK - 64
        # held past the default 1 s: the flag reached the data plane (the handshake's own
        # 10 s deadline ends them instead)
        assert dropped.get('{reason="first_byte_timeout",transport="tcp"}', 0) == 0
