"""resp: RESP replies are read exactly however the stream is cut, payloads land in the caller's
view, and every malformed or error reply is a typed error."""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import MalformedMessageError, OffloadError
from kvplane.offload.tiers.resp import BUFFER_BYTES, MAX_LINE, ReplyReader


def _bulk(data: bytes | None, *, resp3: bool = False) -> bytes:
    if data is None:
        return b"_\r\n" if resp3 else b"$-1\r\n"
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _feed(wire: bytes, cuts: list[int]) -> tuple[socket.socket, threading.Thread]:
    """A socket whose peer sends ``wire`` in pieces cut at ``cuts``, then closes."""
    mine, theirs = socket.socketpair()
    mine.settimeout(10.0)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(wire)), len(wire)]

    def send() -> None:
        with theirs:
            for a, b in itertools.pairwise(bounds):
                theirs.sendall(wire[a:b])

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return mine, t


@pytest.fixture
def reader_of() -> Iterator[object]:
    made: list[tuple[socket.socket, threading.Thread]] = []

    def make(wire: bytes, cuts: list[int] | None = None) -> ReplyReader:
        sock, t = _feed(wire, cuts or [])
        made.append((sock, t))
        return ReplyReader(sock)

    yield make
    for sock, t in made:
        sock.close()
        t.join(timeout=10)


@settings(max_examples=40, deadline=None)
@given(
    payload_len=st.sampled_from([0, 1, 100, BUFFER_BYTES - 7, BUFFER_BYTES, 3 * BUFFER_BYTES + 5]),
    cuts=st.lists(st.integers(0, 4 * BUFFER_BYTES), max_size=8),
    resp3=st.booleans(),
)
def test_mget_replies_read_exactly_however_the_stream_is_cut(payload_len, cuts, resp3):
    payload = bytes((i * 7 + 3) % 251 for i in range(payload_len))
    header = b"header-bytes"
    wire = (
        b"*2\r\n" + _bulk(header) + _bulk(payload)  # a whole chunk
        + b"*2\r\n" + _bulk(header) + _bulk(None, resp3=resp3)  # its payload is gone
        + b"*2\r\n" + _bulk(None, resp3=resp3) + _bulk(b"xy" * 9)  # no header: skip the payload
        + b"*2\r\n" + _bulk(b"h") + _bulk(payload)
    )  # fmt: skip
    sock, t = _feed(wire, cuts)
    with sock:
        r = ReplyReader(sock)
        assert r.array() == 2
        n = r.bulk_length()
        assert n is not None and r.bulk_bytes(n) == header
        out = bytearray(payload_len + 4)
        assert r.bulk_length() == payload_len
        r.bulk_into(memoryview(out)[:payload_len])
        assert bytes(out[:payload_len]) == payload and out[payload_len:] == bytes(4)
        assert r.array() == 2 and r.bulk_length() == len(header)
        assert r.bulk_bytes(len(header)) == header and r.bulk_length() is None
        assert r.array() == 2 and r.bulk_length() is None
        skipped = r.bulk_length()
        assert skipped == 18
        r.skip(skipped)
        assert r.array() == 2 and r.bulk_length() == 1 and r.bulk_bytes(1) == b"h"
        again = bytearray(payload_len)
        assert r.bulk_length() == payload_len
        r.bulk_into(memoryview(again))
        assert bytes(again) == payload
    t.join(timeout=10)


@pytest.mark.parametrize(
    ("wire", "error", "match"),
    [
        (b"-WRONGTYPE Operation against a key\r\n", OffloadError, "WRONGTYPE"),
        (b"!21\r\nSYNTAX invalid syntax\r\n", OffloadError, "reply: SYNTAX invalid syntax$"),
        (b"!9999\r\n", MalformedMessageError, "blob error length 9999"),
        (b"+OK\r\n", MalformedMessageError, "expected a b'\\*'"),
        (b"*two\r\n", MalformedMessageError, "bad Redis reply length"),
        (b"*-5\r\n", MalformedMessageError, "out of range"),
        (b"*" + b"9" * (MAX_LINE + 10), MalformedMessageError, "over"),
        (b"*2\r\n$3\r\nabcde", MalformedMessageError, "CRLF"),
        (b"*2\r\n$10\r\nabc", ConnectionError, "mid-reply"),
        (b"*2", ConnectionError, "closed"),
    ],
)
def test_bad_replies_are_typed_errors(reader_of, wire, error, match):
    r = reader_of(wire)
    with pytest.raises(error, match=match):
        assert r.array() == 2
        n = r.bulk_length()
        assert n is not None
        r.bulk_into(memoryview(bytearray(n)))
