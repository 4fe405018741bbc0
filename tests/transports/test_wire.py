"""wire: typed metadata and frames; malformed or oversized input is refused before use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import IncompatiblePeerError, MalformedMessageError
from kvplane.transports.base import DescriptorList
from kvplane.transports.wire import (
    HEADER,
    MAGIC,
    MAX_CONTROL_BYTES,
    MAX_FRAME_DESCRIPTORS,
    WIRE_VERSION,
    FrameType,
    Header,
    Metadata,
    RegionInfo,
    decode_metadata,
    encode,
    pack_header,
    pack_table,
    parse_header,
    parse_table,
)


def test_metadata_round_trip():
    meta = Metadata(WIRE_VERSION, "tcp", "a", "127.0.0.1:5", "h", [RegionInfo(1, 64, 0, 2, 8)])
    assert decode_metadata(encode(meta), "tcp") == meta


def test_metadata_refusals():
    with pytest.raises(IncompatiblePeerError, match="wire version 99"):
        decode_metadata(encode(Metadata(99, "tcp", "a")), "tcp")
    with pytest.raises(IncompatiblePeerError, match="for transport 'shm', not 'tcp'"):
        decode_metadata(encode(Metadata(WIRE_VERSION, "shm", "a")), "tcp")
    with pytest.raises(MalformedMessageError, match="empty agent"):
        decode_metadata(encode(Metadata(WIRE_VERSION, "tcp", "")), "tcp")
    with pytest.raises(MalformedMessageError, match="malformed Metadata"):
        decode_metadata(b"\x93garbage", "tcp")
    with pytest.raises(MalformedMessageError, match="exceeds"):
        decode_metadata(b"\x00" * (MAX_CONTROL_BYTES + 1), "tcp")
    with pytest.raises(MalformedMessageError, match="must be bytes"):
        decode_metadata("text", "tcp")  # type: ignore[arg-type]


def test_header_round_trip_and_refusals():
    raw = pack_header(FrameType.DATA, 7, 100, count=3, flags=2)
    assert len(raw) == HEADER.size == 28
    assert parse_header(raw) == Header(FrameType.DATA, 2, 3, 7, 100)
    bad = {
        "bad frame magic": HEADER.pack(b"XXXX", WIRE_VERSION, 6, 0, 0, 1, 0),
        "frame version 9": HEADER.pack(MAGIC, 9, 6, 0, 0, 1, 0),
        "unknown frame type 77": HEADER.pack(MAGIC, WIRE_VERSION, 77, 0, 0, 1, 0),
        "descriptors": HEADER.pack(MAGIC, WIRE_VERSION, 6, 0, MAX_FRAME_DESCRIPTORS + 1, 1, 0),
        "ACK frame body": HEADER.pack(MAGIC, WIRE_VERSION, 9, 0, 0, 1, MAX_CONTROL_BYTES + 1),
        "READ_REQ frame payload 5": HEADER.pack(MAGIC, WIRE_VERSION, 10, 0, 1, 1, 5),
    }
    for message, frame in bad.items():
        with pytest.raises(MalformedMessageError, match=message):
            parse_header(frame)


def test_table_round_trip_and_refusals():
    descs = DescriptorList.of([(1, 0, 10), (2, 5, 3)])
    assert parse_table(pack_table(descs), 2).equals(descs)
    with pytest.raises(MalformedMessageError, match="48 bytes for 3 entries"):
        parse_table(pack_table(descs), 3)
    with pytest.raises(MalformedMessageError, match="lengths > 0"):
        parse_table(pack_table(DescriptorList.of([(1, 0, 1)]))[:16] + (0).to_bytes(8, "little"), 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size))
def test_any_header_bytes_parse_or_are_refused_typed(raw):
    try:
        header = parse_header(raw)
    except MalformedMessageError:
        return
    assert header.count <= MAX_FRAME_DESCRIPTORS and raw[:4] == MAGIC
